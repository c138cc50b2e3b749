"""The import graph of pipelines/, tasks/ and training/, and the size of their modules.

Checked over the source with `ast` (imports under `TYPE_CHECKING` and inside functions count):
no import cycle between modules, nor between the sub-packages of a top-level package; the
sub-packages of training/ in their order (`TRAINING_LAYERS`); nothing in tasks/ or training/
imports pipelines/, nothing in tasks/ imports training/; no module over 500 lines and no
function over 60 (bench/ included). Written with the move into sub-packages; the allow-lists
below hold what was true then and may only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "tasks", "training")
SIZED = (*PACKAGES, "bench")  # the size limits hold for the benchmarks too
MAX_LINES = 500
MAX_FUNCTION_LINES = 60
# The sub-packages of training/, lowest first: each imports only those on a lower rank, so
# pretrain and finetune (one rank) never import each other, and what both use sits below them.
TRAINING_LAYERS = {
    "models": 0,
    "tracking": 1,
    "scoring": 1,
    "runtime": 2,
    "pretrain": 3,
    "finetune": 3,
    "evaluate": 4,
}

# Known violations when the check was written; fix them, then delete their line here.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_LONG_MODULES: set[str] = set()


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports, resolved to modules (not packages) when it can."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_the_import_graph_has_no_cycles_beyond_the_known_ones() -> None:
    found = cycles(graph())
    assert found <= KNOWN_CYCLES, [sorted(c) for c in found - KNOWN_CYCLES]
    assert found >= KNOWN_CYCLES, [sorted(c) for c in KNOWN_CYCLES - found]


def test_nothing_in_tasks_or_training_imports_pipelines() -> None:
    edges = graph()
    bad = sorted(
        (name, target)
        for name, targets in edges.items()
        if not name.startswith("pipelines")
        for target in targets
        if target.split(".")[0] == "pipelines"
    )
    assert bad == []


def test_nothing_in_tasks_imports_training() -> None:
    edges = graph()
    bad = sorted(
        (name, target)
        for name, targets in edges.items()
        if name.split(".")[0] == "tasks"
        for target in targets
        if target.split(".")[0] == "training"
    )
    assert bad == []


def unit(name: str) -> str:
    """The sub-package (or top-level module) of a top-level package that `name` belongs to."""
    return ".".join(name.split(".")[:2])


def unit_graph() -> dict[str, set[str]]:
    """The imports between the sub-packages of each top-level package (not across packages)."""
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        edges.setdefault(unit(name), set())
        for target in targets:
            same_package = target.split(".")[0] == name.split(".")[0]
            if same_package and unit(target) != unit(name):
                edges[unit(name)].add(unit(target))
                edges.setdefault(unit(target), set())
    return edges


def test_no_import_cycle_between_the_sub_packages_of_a_package() -> None:
    assert cycles(unit_graph()) == set(), [sorted(c) for c in cycles(unit_graph())]


def test_training_sub_packages_import_only_those_below_them() -> None:
    edges = unit_graph()
    subs = {name.split(".")[1] for name in edges if name.startswith("training.")}
    assert subs <= set(TRAINING_LAYERS), f"place {sorted(subs - set(TRAINING_LAYERS))} in an order"
    rank = {f"training.{sub}": level for sub, level in TRAINING_LAYERS.items()}
    upward = sorted(
        (name, target)
        for name, targets in edges.items()
        if name in rank
        for target in targets
        if rank[target] >= rank[name]
    )
    assert upward == []


def test_no_function_is_over_the_line_limit() -> None:
    long = []
    for name, path in modules(SIZED).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {size} lines")
    assert long == []


def test_no_module_is_over_the_line_limit_beyond_the_known_ones() -> None:
    long = {
        name
        for name, path in modules(SIZED).items()
        if len(path.read_text().splitlines()) > MAX_LINES
    }
    assert long <= KNOWN_LONG_MODULES, sorted(long - KNOWN_LONG_MODULES)
    assert long >= KNOWN_LONG_MODULES, sorted(KNOWN_LONG_MODULES - long)


def test_docs_architecture_names_every_sub_package_and_its_modules() -> None:
    """docs/architecture.md has a line per sub-package, ending in the list of its modules."""
    lines = (REPO / "docs" / "architecture.md").read_text().splitlines()
    wrong = []
    for package in PACKAGES:
        for init in sorted((REPO / package).rglob("*/__init__.py")):
            folder = init.parent.relative_to(REPO).as_posix()
            line = next((x for x in lines if x.startswith(f"- `{folder}/`:")), None)
            if line is None:
                wrong.append(f"{folder}/: no line")
                continue
            listed = {name.strip() for name in line.rpartition("(")[2].rstrip(")").split(",")}
            found = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"}
            found |= {f"{d.name}/" for d in init.parent.iterdir() if (d / "__init__.py").is_file()}
            others = {name for name in listed - found if (init.parent / name).is_file()}
            if listed - others != found:
                wrong.append(f"{folder}/: lists {sorted(listed)}, holds {sorted(found)}")
    assert wrong == []
