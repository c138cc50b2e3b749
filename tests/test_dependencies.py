"""pyproject.toml declares what pipelines/, tasks/ and training/ import, and nothing unused.

Both directions, from the source (`ast`) and the installed metadata, without importing any of
it: every third-party distribution the three packages import (at the top of a module, inside a
function or under `TYPE_CHECKING`) is in `[project].dependencies` with a lower bound, so it
never arrives only as somebody else's dependency; and every declared distribution is imported,
or is a dependency of one that is (a pin or security floor on the stack's own requirements,
such as fastapi for Prefect's server). Declared extras are followed when the tree is walked.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "tasks", "training")
# Declared, neither imported nor required by what is: each needs its reason here.
ALLOWED_UNUSED: dict[str, str] = {}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules() -> dict[str, set[str]]:
    """Third-party top-level modules the packages import, each with the files that import it."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


@cache
def declared() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(spec) for spec in project["dependencies"]]
    return {normalize(r.name): r for r in requirements}


def requirement_closure(roots: dict[str, set[str]]) -> set[str]:
    """Every installed distribution the `roots` (name -> extras asked for) need, transitively."""
    seen: set[str] = set()
    todo = list(roots.items())
    while todo:
        name, extras = todo.pop()
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # excluded by its marker on this platform
        for spec in requires:
            try:
                req = Requirement(spec)
            except InvalidRequirement:
                continue
            wanted = {"", *extras}
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": extra}) for extra in wanted
            ):
                continue
            child = normalize(req.name)
            if child not in seen:
                seen.add(child)
                todo.append((child, set(req.extras)))
    return seen


@cache
def imported_distributions() -> dict[str, set[str]]:
    """Distributions imported (normalized name -> files); a module several distributions
    provide (mlflow: mlflow, mlflow-skinny, ...) counts as the declared one among them."""
    providers = md.packages_distributions()
    result: dict[str, set[str]] = {}
    for module, files in imported_modules().items():
        candidates = [normalize(d) for d in providers.get(module, [module])]
        chosen = [d for d in candidates if d in declared()] or candidates
        result.setdefault(chosen[0], set()).update(files)
    return result


def test_every_imported_distribution_is_declared_with_a_lower_bound() -> None:
    imported = imported_distributions()
    missing = {d: sorted(files)[:3] for d, files in imported.items() if d not in declared()}
    assert missing == {}, f"imported but not in [project].dependencies: {missing}"
    unbounded = [
        str(declared()[d])
        for d in imported
        if not any(s.operator in (">=", "==", "~=", ">") for s in declared()[d].specifier)
    ]
    assert unbounded == [], f"declared without a lower bound: {unbounded}"


def test_every_declared_distribution_is_imported_or_needed_by_one_that_is() -> None:
    imported = imported_distributions()
    roots = {d: set(declared()[d].extras) for d in imported if d in declared()}
    needed = set(imported) | requirement_closure(roots)
    unused = sorted(set(declared()) - needed - set(ALLOWED_UNUSED))
    assert unused == [], f"declared, but nothing imports or needs them: {unused}"
