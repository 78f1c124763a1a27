"""The package's import graph: no circles, and no import from a lower floor to a higher one.

Every ``import`` and ``from … import`` of every module counts: module level, inside functions,
and under ``if TYPE_CHECKING:``. A type-only import still makes the importing module depend on
the imported one (a reader has to understand both together), and a function-level import still
runs, so none of them may run back up or close a circle. An import of a package's ``__init__``
counts as an edge to that package; the implicit import of a parent package does not.

Floors, lowest first (as in the design overview, with the folders placed): a module may import
its own floor and the floors below it. Inside one floor, the circle check is what keeps order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import weft_sync

PACKAGE = Path(weft_sync.__file__).parent

# (floor, dotted prefix); a module belongs to the longest prefix naming it.
FLOORS: tuple[tuple[int, str], ...] = (
    (0, "weft_sync.errors"),
    (0, "weft_sync.clock"),
    (0, "weft_sync.options"),
    (0, "weft_sync.redaction"),
    (0, "weft_sync.histograms"),
    (0, "weft_sync.tracing"),
    (0, "weft_sync.metrics"),
    (0, "weft_sync._fork"),
    (1, "weft_sync.keys"),
    (1, "weft_sync.codec"),
    # the storage protocol and what every backend shares
    (2, "weft_sync.storage.base"),
    (2, "weft_sync.storage.cas"),
    (2, "weft_sync.storage.reads"),
    (2, "weft_sync.storage.read_then_write"),
    (2, "weft_sync.storage.isolation"),
    (2, "weft_sync.storage.wait_bound"),
    (2, "weft_sync.storage.session_locks"),
    (2, "weft_sync.storage.fence_proof"),
    # the backends (and SQLite's process-level helpers)
    (3, "weft_sync.storage.sqlite"),
    (3, "weft_sync.storage.postgres"),
    # opening a store from a URL
    (4, "weft_sync.storage"),
    (5, "weft_sync.claims"),
    (6, "weft_sync.reclaim"),
    (7, "weft_sync.maintenance"),
    (8, "weft_sync.ledger"),
    (8, "weft_sync.workflows"),
    (9, "weft_sync.fencing"),
    (10, "weft_sync.ownership"),
    (10, "weft_sync.demo"),
    (11, "weft_sync"),
    (11, "weft_sync.cli"),
    (12, "weft_sync.flask"),
    (12, "weft_sync.django"),
    (12, "weft_sync.__main__"),
)

# Upward imports still waiting for their fix, each with the reason. An entry that no longer
# occurs fails the test too, so the list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str) -> dict[str, int]:
    """Modules of this package that ``module`` imports -> the line of the first such import."""
    path, is_package = MODULES[module]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                targets.append(candidate if candidate in MODULES else base)
        for target in targets:
            # ``import a.b.c`` names module a.b.c; an attribute path names its longest module
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def floor_of(module: str) -> int:
    best: tuple[int, int] | None = None
    for floor, prefix in FLOORS:
        names_it = module == prefix or module.startswith(prefix + ".")
        if names_it and (best is None or len(prefix) > best[0]):
            best = (len(prefix), floor)
    assert best is not None, f"{module} has no floor: add it to FLOORS"
    return best[1]


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_graph_sees_the_imports_it_must_judge() -> None:
    # The facade imports the registry (module level), the engine builder imports the ledger,
    # and the CLI imports the handler type under TYPE_CHECKING: all three are edges.
    assert "weft_sync.claims.registry" in GRAPH["weft_sync.ownership.facade"]
    assert "weft_sync.workflows" in GRAPH["weft_sync.ownership.engine"]
    assert "weft_sync.ownership" in GRAPH["weft_sync.cli.app"]
    assert len(MODULES) > 100


def test_no_module_has_an_import_circle() -> None:
    assert _cycles() == []


def test_every_module_has_a_floor() -> None:
    for module in MODULES:
        floor_of(module)


def test_no_import_runs_from_a_lower_floor_to_a_higher_one() -> None:
    upward = [
        f"{module}:{line} imports {target} (floor {floor_of(module)} -> {floor_of(target)})"
        for module, targets in sorted(GRAPH.items())
        for target, line in sorted(targets.items())
        if floor_of(target) > floor_of(module) and (module, target) not in KNOWN_UPWARD
    ]
    assert upward == []


def test_every_known_upward_import_still_occurs() -> None:
    stale = [edge for edge in KNOWN_UPWARD if edge[1] not in GRAPH.get(edge[0], {})]
    assert stale == [], "fixed: remove these from KNOWN_UPWARD"
