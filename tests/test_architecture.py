"""No mutable state at module level under mgpu/: what a worker keeps lives in its runtime
(:mod:`mgpu.worker.runtime`), made at setup and freed at teardown, so two workers in one process
share nothing and a worker that closes leaves nothing behind. And no import circle among
mgpu's modules, counting the imports made inside functions: the runtime is handed down.

A module may hold constant tables: a container bound to an ALL_CAPS name (or one annotated
``Final``) that the module never changes. Locks, thread-locals and the like made at import
are state whatever their name, and so is a name that functions rebind (``global``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mgpu"

_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
# Made at import, these are state under any name.
_STATEFUL = {
    "Lock",
    "RLock",
    "Semaphore",
    "BoundedSemaphore",
    "Condition",
    "Event",
    "local",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "Queue",
    "SimpleQueue",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
}
_CONTAINER_CALLS = {"dict", "list", "set", "bytearray"}
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "popitem",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "difference_update",
    "intersection_update",
    "symmetric_difference_update",
    "sort",
    "reverse",
    "__setitem__",
    "__delitem__",
}


def _called(node: ast.expr) -> str | None:
    """The last name of what ``node`` calls (``threading.Lock()``: "Lock"), if it is a call."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _made(value: ast.expr) -> str | None:
    """ "state" or "container" for a value made at import that is one, else None."""
    if isinstance(value, ast.IfExp):
        kinds = {_made(value.body), _made(value.orelse)}
        return "state" if "state" in kinds else "container" if "container" in kinds else None
    if _called(value) in _STATEFUL:
        return "state"
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return "container"
    if _called(value) in _CONTAINER_CALLS:
        return "container"
    return None


def _is_final(annotation: ast.expr | None) -> bool:
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Final"
    return isinstance(annotation, ast.Name) and annotation.id == "Final"


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run at import: the module's, and those of its top-level if/try/with."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.With, ast.Try)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(stmt, block, []):
                    yield from _module_statements(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])


def _bindings(stmt: ast.stmt) -> Iterator[tuple[str, ast.expr, ast.expr | None]]:
    """(name, value, annotation) of each module-level name ``stmt`` binds to a value."""
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
        yield stmt.target.id, stmt.value, stmt.annotation
    elif isinstance(stmt, ast.Assign):
        for target in stmt.targets:
            if isinstance(target, ast.Name):
                yield target.id, stmt.value, None
            elif isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                for t, v in zip(target.elts, stmt.value.elts, strict=False):
                    if isinstance(t, ast.Name):
                        yield t.id, v, None


def _root(node: ast.expr) -> str | None:
    """The name at the root of ``X[k].attr[j]``."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _changed(tree: ast.Module) -> set[str]:
    """Names whose object the module changes in place: item stores and deletes, augmented
    assignments, mutating methods."""
    changed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            target: ast.expr | None = node
        elif isinstance(node, ast.AugAssign) and not isinstance(node.target, ast.Name):
            target = node.target
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            target = node.func.value
        else:
            target = None
        if target is not None and (name := _root(target)) is not None:
            changed.add(name)
    return changed


def module_state(source: str) -> list[tuple[str, str]]:
    """(name, why) of each mutable thing a module's ``source`` keeps at module level."""
    tree = ast.parse(source)
    found = [
        (name, "rebound by a function (global)")
        for name in sorted({n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names})
    ]
    changed = _changed(tree)
    for stmt in _module_statements(tree.body):
        for name, value, annotation in _bindings(stmt):
            kind = _made(value)
            if kind == "state":
                found.append((name, f"line {stmt.lineno}: a {_called(value)}() made at import"))
            elif kind == "container" and not (name.startswith("__") and name.endswith("__")):
                if not (_CONSTANT.match(name) or _is_final(annotation)):
                    found.append((name, f"line {stmt.lineno}: a container neither named as a constant nor Final"))
                elif name in changed:
                    found.append((name, f"line {stmt.lineno}: a container the module changes"))
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_mutable_state_at_module_level(path):
    where = path.relative_to(PACKAGE).as_posix()
    found = [f"{name} ({why})" for name, why in module_state(path.read_text())]
    assert not found, f"mgpu/{where} keeps state at module level; a worker's belongs in its runtime: {found}"


@pytest.mark.parametrize(
    "source, expected",
    [
        # State a worker keeps between tasks, at module level: each is found.
        (
            "_STEPPING: dict = {}\ndef keep(k, v):\n    _STEPPING[k] = v\n",
            [("_STEPPING", "line 1: a container the module changes")],
        ),
        (
            "_SENDING = {}\ndef send(t):\n    return _SENDING.setdefault(t, {})\n",
            [("_SENDING", "line 1: a container the module changes")],
        ),
        (
            "_OPENED = {}\ndef drop(t):\n    _OPENED[t][0] = 1\n",
            [("_OPENED", "line 1: a container the module changes")],
        ),
        ("import threading\n_LOCK = threading.Lock()\n", [("_LOCK", "line 2: a Lock() made at import")]),
        ("from threading import local\n_here = local()\n", [("_here", "line 2: a local() made at import")]),
        (
            "import collections\nif True:\n    BY = collections.defaultdict(list)\n",
            [("BY", "line 3: a defaultdict() made at import")],
        ),
        ("_cache = {}\n", [("_cache", "line 1: a container neither named as a constant nor Final")]),
        ("seen = set()\n", [("seen", "line 1: a container neither named as a constant nor Final")]),
        (
            "from typing import Final\n_K: Final = []\ndef f(x):\n    _K.append(x)\n",
            [("_K", "line 2: a container the module changes")],
        ),
        ("_N = 0\ndef bump():\n    global _N\n    _N += 1\n", [("_N", "rebound by a function (global)")]),
        # Constant tables, and what functions make for themselves: nothing is found.
        ('_C_TYPES = {"float16": "__half"}\n_MATVEC = {n: c for n, c in _C_TYPES.items()}\n', []),
        ('__all__ = ["a"]\nSIZES: dict[str, int] = {"tiny": 1}\ndef f():\n    return dict(SIZES)\n', []),
        ("import typing\n_table: typing.Final = {1: 2}\n", []),
        ("def f():\n    local = {}\n    local[1] = 2\n    return local\n", []),
    ],
)
def test_the_rule_tells_state_from_constant_tables(source, expected):
    assert module_state(source) == expected


# --- import circles -------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``: imports for the type checker, never run."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skip


def imported_modules(name: str, source: str, modules: set[str], *, package: bool = False) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports, at its top or inside functions
    (what ``TYPE_CHECKING`` guards is left out: it never runs)."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
                elif target in modules:
                    found.add(target)
    found.discard(name)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two modules or more that reach each other by imports (Tarjan's strongly
    connected components), each sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return circles


def test_no_import_circle_among_mgpu_modules():
    """A module below imports none above it, not even inside a function: the worker's runtime
    is handed down, never looked up from below."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: imported_modules(name, path.read_text(), set(paths), package=path.name == "__init__.py")
        for name, path in paths.items()
    }
    assert import_circles(graph) == []


@pytest.mark.parametrize("container", ["mgpu.client", "mgpu.worker"])
def test_every_module_of_a_layered_side_stands_in_a_layer(container):
    """A module the layers contract does not name is held to no order: each must be in one."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: import-linter's own TOML reader
        import tomli as tomllib

    contracts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("containers") == [container]]
    named = {m.strip() for layer in layers for m in re.split(r"[|:]", layer)}
    modules = {p.stem for p in (PACKAGE / container.split(".")[1]).glob("*.py") if p.stem != "__init__"}
    assert modules - named == set()


def test_a_function_level_import_from_below_closes_a_circle():
    # The shape the runtime once had: the device, below it, reached up for it in a function.
    modules = {"pkg", "pkg.runtime", "pkg.device", "pkg.tile"}
    sources = {
        "pkg.runtime": "from .device import Device\nfrom .tile import StepStore\n",
        "pkg.device": "def current():\n    from .runtime import current as up\n    return up().device\n",
        "pkg.tile": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .runtime import Runtime\n",
        "pkg": "",
    }
    graph = {name: imported_modules(name, src, modules) for name, src in sources.items()}
    assert graph["pkg.device"] == {"pkg.runtime"}
    assert graph["pkg.tile"] == set()  # for the type checker only
    assert import_circles(graph) == [["pkg.device", "pkg.runtime"]]


# --- the plug-in contract ---------------------------------------------------------------------

PLUG_IN = PACKAGE.parent / "examples" / "mgpu-stencil" / "mgpu_stencil"


def mgpu_imports(source: str) -> set[str]:
    """The mgpu modules ``source`` imports from (``from mgpu.x import y`` names ``mgpu.x``;
    ``from mgpu import x`` names ``mgpu.x``), anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mgpu"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "mgpu":
            if node.module == "mgpu":
                found |= {f"mgpu.{a.name}" for a in node.names}
            else:
                found.add(node.module or "")
    return found


def test_the_stencil_plug_in_imports_only_the_public_contract():
    used = {path.name: mgpu_imports(path.read_text()) for path in sorted(PLUG_IN.glob("*.py"))}
    assert set().union(*used.values()) == {"mgpu.workload"}, used


def test_every_name_the_contract_exports_is_there():
    import mgpu.workload

    assert all(hasattr(mgpu.workload, name) for name in mgpu.workload.__all__)
    assert mgpu_imports("from mgpu.workload import Workload\nfrom mgpu import workload\nimport mgpu.worker.tile\n") == {
        "mgpu.workload",
        "mgpu.worker.tile",
    }


# --- the harness on demand --------------------------------------------------------------------


def test_the_command_line_loads_the_benchmark_harness_only_when_mgpu_bench_runs():
    import subprocess
    import sys

    loaded = "import sys, mgpu.cli; print(sorted(m for m in sys.modules if m.split('.')[:2] == ['mgpu', 'bench']))"
    out = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # The command is still there, and loads its suites when it runs.
    listed = subprocess.run([sys.executable, "-m", "mgpu", "bench", "--help"], capture_output=True, text=True)
    assert listed.returncode == 0 and "outofcore" in listed.stdout, listed.stderr
