"""`recipe_flow`, the decorator of every lmpipe flow: Prefect's `@flow`, less three fixed costs.

- Prefect's `Flow.__init__` builds `parameters`, the JSON schema of the flow's parameters (the
  form of a run in the UI), when the flow is defined. For a `RunConfig` that is pydantic's JSON
  schema of the whole config, built twice: 0.2-0.3 s of every command on a 2-core machine. No
  flow run reads it, and a deployment builds its own from the function (`to_deployment`), so a
  `RecipeFlow` builds it on first use instead.
- Prefect records a flow run's parameters as JSON values, through FastAPI's `jsonable_encoder`;
  importing FastAPI for it took 0.25 s. For a pydantic model such as `RunConfig` that encoder
  returns `model_dump(mode="json", by_alias=True)`, which `RecipeFlow` calls itself: the
  recorded parameters are the same (secrets masked alike).
- At the end of every flow run Prefect's engine stops the run's heartbeat thread and waits for
  it (`prefect.flow_engine._send_heartbeats`); the thread sleeps in steps of 1 s, so the wait
  was 0.45-0.56 s of every command. A `RecipeFlow`'s run does not wait, as Prefect's async
  flow runs do not (`join_on_exit=False`): the thread, a daemon, stops at its next step, and
  sends no heartbeat after the stop. Heartbeats are sent as before while the flow runs.

A call waits first for the temporary Prefect API the command started in the background while
it imported Prefect and the flows (`pipelines.ops.prefect_api`); a no-op when there is none.
Everything else is Prefect's `Flow`. The flows themselves live one per module beside this one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

import prefect.flow_engine
import prefect.flows
from prefect import Flow
from prefect.utilities.callables import ParameterSchema, parameter_schema
from pydantic import BaseModel

from pipelines.ops.prefect_api import await_prefect_api

P = ParamSpec("P")
R = TypeVar("R")

#: Parameter values that are JSON already: `jsonable_encoder` returns them unchanged.
_JSON_SCALARS = (str, int, float, bool, type(None))
#: What `Flow.__init__` stores as `parameters` while a `RecipeFlow` is made: built on first use.
_DEFERRED = ParameterSchema(title="Parameters")
_DEFINING = threading.Lock()


def _deferred_schema(fn: Callable[..., Any]) -> ParameterSchema:
    return _DEFERRED


@contextlib.contextmanager
def _schema_deferred() -> Iterator[None]:
    """Make `Flow.__init__` store `_DEFERRED` as the schema, in place of building it.

    `Flow.__init__` (Prefect 3.8) calls `prefect.flows.parameter_schema`, swapped here while
    one `RecipeFlow` is made at a time; a plain `Flow` made by another thread meanwhile would
    get `_DEFERRED` as its schema. Flows are made when their modules are imported.
    """
    names = vars(prefect.flows)
    with _DEFINING:
        built = names["parameter_schema"]  # a KeyError if Prefect no longer calls it so
        names["parameter_schema"] = _deferred_schema
        try:
            yield
        finally:
            names["parameter_schema"] = built


class RecipeFlow(Flow[P, R]):
    """A Prefect flow: parameter schema built on first use, parameters sent without FastAPI."""

    def __init__(self, fn: Callable[P, R], name: str) -> None:
        """Make the flow of `fn`, named `name`, as `@flow(name=name)` does."""
        self._schema: ParameterSchema | None = None
        with _schema_deferred():
            super().__init__(fn, name=name)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:  # type: ignore[override]
        """Run the flow as `Flow.__call__` does, once the command's Prefect API answers."""
        await_prefect_api()
        return super().__call__(*args, **kwargs)

    @property
    def parameters(self) -> ParameterSchema:
        """The JSON schema of the flow's parameters, as Prefect builds it; built on first use."""
        if self._schema is None:
            self._schema = parameter_schema(self.fn)
        return self._schema

    @parameters.setter
    def parameters(self, schema: ParameterSchema) -> None:
        self._schema = None if schema is _DEFERRED else schema

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """Return the parameters as the JSON values Prefect records with the flow run.

        A pydantic model is dumped in JSON mode by alias, a JSON scalar kept; any other value
        (a future, a state, a dataclass) goes through Prefect's own serialisation.
        """
        done: dict[str, Any] = {}
        for key, value in parameters.items():
            if type(value) in _JSON_SCALARS:  # exactly: an enum member is encoded by its value
                done[key] = value
            elif isinstance(value, BaseModel):
                with contextlib.suppress(ValueError):  # unserialisable: Prefect's placeholder
                    done[key] = value.model_dump(mode="json", by_alias=True)
        rest = {key: value for key, value in parameters.items() if key not in done}
        if rest:
            done |= super().serialize_parameters(rest)
        return {key: done[key] for key in parameters if key in done}


_engine_heartbeats: Callable[..., AbstractContextManager[None]] = vars(prefect.flow_engine)[
    "_send_heartbeats"
]


def _heartbeats(engine: Any, join_on_exit: bool = True) -> AbstractContextManager[None]:
    """Prefect's flow-run heartbeats; the engine of a `RecipeFlow` does not wait for their end."""
    joined = join_on_exit and not isinstance(getattr(engine, "flow", None), RecipeFlow)
    return _engine_heartbeats(engine, join_on_exit=joined)


vars(prefect.flow_engine)["_send_heartbeats"] = _heartbeats


def recipe_flow(name: str) -> Callable[[Callable[P, R]], RecipeFlow[P, R]]:
    """`@flow(name=name)`, making a `RecipeFlow`."""

    def decorate(fn: Callable[P, R]) -> RecipeFlow[P, R]:
        return RecipeFlow(fn, name=name)

    return decorate
