"""`recipe_flow`, the decorator of every lmpipe flow: Prefect's `@flow`, minus a FastAPI import.

Prefect records a flow run's parameters as JSON values, through FastAPI's `jsonable_encoder`;
importing FastAPI for that took 0.25 s of a cache-hit rerun on a 2-core machine. For a pydantic
model such as `RunConfig`, `jsonable_encoder` returns `model_dump(mode="json", by_alias=True)`,
which `RecipeFlow` calls itself: the recorded parameters are the same (secrets masked alike).
Everything else is Prefect's `Flow`. The flows themselves live one per module beside this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import Flow
from pydantic import BaseModel

P = ParamSpec("P")
R = TypeVar("R")

#: Parameter values that are JSON already: `jsonable_encoder` returns them unchanged.
_JSON_SCALARS = (str, int, float, bool, type(None))


class RecipeFlow(Flow[P, R]):
    """A Prefect flow that serialises pydantic and scalar parameters without FastAPI."""

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


def recipe_flow(name: str) -> Callable[[Callable[P, R]], RecipeFlow[P, R]]:
    """`@flow(name=name)`, making a `RecipeFlow`."""

    def decorate(fn: Callable[P, R]) -> RecipeFlow[P, R]:
        return RecipeFlow(fn, name=name)

    return decorate
