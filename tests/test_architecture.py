"""The shape of the package, read from its source: layers that only point down.

The test parses every module of src/overlapkit (no import of the package, so it is fast and
needs no torch) and builds the import graph, function-level imports included. It fails on:

- an import circle between modules;
- a module using a private name (``_x``) of a module in another folder, imported or read as an
  attribute of an imported module or class;
- a module over ``MAX_LINES`` lines;
- an import that climbs: a module of a lower layer importing one of an upper layer, or the two
  analysis parts (timeline analysis and cost model) importing each other;
- text about how the package was made ("seed 004", "issue 25") anywhere in the package;
- an import of an overlapkit module that does not exist (a module moved, an import left behind);
- a module-level empty dict, set or list, or a `global` statement rebinding a module name (state
  that outlives a call belongs in runtime.state, which a test can reset).

docs/architecture.md draws the layers this test enforces.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "overlapkit"
MAX_LINES = 400

# Modules allowed over MAX_LINES, each with the reason. This list only shrinks.
LONG_MODULES: dict[str, str] = {}

# The layers, bottom first. A module belongs to the first entry whose prefix matches its name.
# A module may import modules of its own layer or of lower layers only; inside the engines layer
# the engines themselves are ordered (a later engine may use an earlier one, not the reverse).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("overlapkit.vocabulary",)),  # torch-free: sizes, overlap modes, validators
    ("runtime", ("overlapkit.runtime",)),
    ("analysis", ("overlapkit.timeline", "overlapkit.costmodel")),
    ("engines", (
        "overlapkit.tensor_parallel",
        "overlapkit.data_parallel",
        "overlapkit.expert_parallel",
        "overlapkit.context_parallel",
        "overlapkit.pipeline_parallel",
        "overlapkit.inference",  # serving: the fused decode all-reduce on the TP layers, decode steps on the timeline
        "overlapkit.optim",
    )),
    ("models", ("overlapkit.models",)),
    ("integrations", ("overlapkit.integrations",)),  # Trainer, accelerate, torchtitan: engines on their loops
    ("tools", (
        "overlapkit.launch",
        "overlapkit.demos",
        "overlapkit.doctor",
        "overlapkit.analyze_tool",
        "overlapkit.plan_tools",
        "overlapkit.probe",
        "overlapkit.cli",
        "overlapkit.__main__",
    )),
]

# Engines: the order in which one may build on another (index in the engines entry above).
ENGINE_ORDER = dict((name, i) for i, name in enumerate(LAYERS[3][1]))

# Parts of one layer that must never import each other: they meet through a type below both.
SIBLINGS = [("overlapkit.timeline", "overlapkit.costmodel")]

# Text that speaks of how the package was made, not of what it does.
FORBIDDEN_TEXT = re.compile(r"seed\s+0\d|\bissue\s+#?\d|\bsession\s+\d", re.IGNORECASE)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _folder(name: str) -> str:
    """The folder (package) a module lives in: overlapkit.timeline.trace -> overlapkit.timeline."""
    return name if _is_package(name) else name.rpartition(".")[0]


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer if _is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


class _Imports(ast.NodeVisitor):
    """Every overlapkit import of one module (any depth), and the private names it uses."""

    def __init__(self, name: str):
        self.name = name
        self.edges: list[tuple[str, int]] = []  # (imported module, line)
        self.private: list[tuple[str, str, int]] = []  # (owner module, private name, line)
        self.bound: dict[str, str] = {}  # local name -> overlapkit module that defines it
        self.defines: set[str] = set()  # private names this module defines (functions, attributes)
        self.reads: list[tuple[str, int]] = []  # private attributes read off objects, not self/cls
        self.unknown: list[tuple[str, int]] = []  # overlapkit modules imported that do not exist

    def _edge(self, target: str, line: int) -> None:
        if target in MODULES and target != self.name:
            self.edges.append((target, line))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith(PACKAGE):
                if alias.name not in MODULES:
                    self.unknown.append((alias.name, node.lineno))
                self._edge(alias.name, node.lineno)
                if alias.asname:
                    self.bound[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve(self.name, node)
        if not module.startswith(PACKAGE):
            return
        if module not in MODULES:  # a module moved away, an import left behind (a merge, say)
            self.unknown.append((module, node.lineno))
        for alias in node.names:
            if module == PACKAGE and alias.name.startswith("__"):
                continue  # `from overlapkit import __version__`: a constant, not a climb
            sub = f"{module}.{alias.name}"
            if sub in MODULES:  # `from overlapkit import comm` imports a module
                self._edge(sub, node.lineno)
                owner = module
            else:
                self._edge(module, node.lineno)
                owner = module
            if _private(alias.name):
                self.private.append((owner, alias.name, node.lineno))
            self.bound[alias.asname or alias.name] = sub if sub in MODULES else module

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr):
            if isinstance(node.ctx, ast.Store):
                self.defines.add(node.attr)
            elif isinstance(node.value, ast.Name) and node.value.id in self.bound:
                self.private.append((self.bound[node.value.id], node.attr, node.lineno))
            elif not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                self.reads.append((node.attr, node.lineno))
        self.generic_visit(node)

    def _define(self, node) -> None:
        if _private(node.name):
            self.defines.add(node.name)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _define

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store) and _private(node.id):
            self.defines.add(node.id)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _scan() -> dict[str, _Imports]:
    out = {}
    for name, path in MODULES.items():
        visitor = _Imports(name)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        out[name] = visitor
    return out


SCAN = _scan()


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(SRC.parent)}:{line}"


def _layer(name: str) -> tuple[int, str | None]:
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                return i, prefix
    return -1, None


def test_every_module_has_a_layer():
    lost = [name for name in MODULES if name != PACKAGE and _layer(name)[0] < 0]
    assert not lost, f"modules in no layer (add them to LAYERS): {lost}"


def _circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): every circle lies in one."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                strongconnect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in list(graph):
        if node not in index:
            strongconnect(node)
    return circles


def test_every_import_names_a_module_that_exists():
    found = [f"{_where(name, line)} imports {target}" for name, scan in SCAN.items() for target, line in scan.unknown]
    assert not found, "imports of overlapkit modules that do not exist:\n" + "\n".join(found)


def test_no_import_circles():
    graph = {name: sorted({t for t, _ in SCAN[name].edges}) for name in MODULES}
    circles = _circles(graph)
    assert not circles, "modules importing each other, directly or around a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_checks_see_what_they_look_for():
    """The scanner on made-up sources: a circle, a private import, a private read, a function-level import."""
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    scan = _Imports("overlapkit.tensor_parallel.layers")
    scan.visit(ast.parse("from ..runtime.comm import _launch\n"
                         "from ..runtime import recorder as rec\n"
                         "def f(h):\n"
                         "    from ..models import gpt\n"
                         "    return rec._now(), h._pending\n"))
    assert ("overlapkit.runtime.comm", "_launch", 1) in scan.private
    assert ("overlapkit.runtime.recorder", "_now", 5) in scan.private
    assert ("_pending", 5) in scan.reads
    assert ("overlapkit.models.gpt", 4) in scan.edges
    scan = _Imports("overlapkit.data_parallel.fsdp")
    scan.visit(ast.parse("from ..tuning import MeasuredChoice\nimport overlapkit.comm\n"))
    assert scan.unknown == [("overlapkit.tuning", 1), ("overlapkit.comm", 2)]
    assert FORBIDDEN_TEXT.search("as seed 004 says") and FORBIDDEN_TEXT.search("fixed in issue 25")
    assert not FORBIDDEN_TEXT.search("issue the all-gather before the GEMM")


def test_no_private_names_across_folders():
    defined_in: dict[str, set[str]] = {}  # private name -> folders defining it
    for name, scan in SCAN.items():
        for private in scan.defines:
            defined_in.setdefault(private, set()).add(_folder(name))
    found = []
    for name, scan in SCAN.items():
        for owner, attr, line in scan.private:
            if _folder(owner) != _folder(name):
                found.append(f"{_where(name, line)} uses {owner}.{attr}")
        # An attribute read off an object (a recorder, a handle): private to another folder when
        # only another folder defines that name.
        for attr, line in scan.reads:
            folders = defined_in.get(attr, set())
            if folders and _folder(name) not in folders:
                found.append(f"{_where(name, line)} reads .{attr}, private to {sorted(folders)}")
    assert not found, "private names used across folders:\n" + "\n".join(found)


def test_modules_are_short():
    long = {}
    for name, path in MODULES.items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and name not in LONG_MODULES:
            long[name] = n
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_long_module_exemptions_still_needed():
    stale = [n for n in LONG_MODULES if len(MODULES[n].read_text().splitlines()) <= MAX_LINES]
    assert not stale, f"remove from LONG_MODULES, they are short now: {stale}"


def test_imports_only_point_down():
    climbs = []
    for name, scan in SCAN.items():
        if name == PACKAGE:
            continue  # the top-level package names things lazily for users
        low, low_part = _layer(name)
        if low < 0:
            continue  # test_every_module_has_a_layer names it
        for target, line in scan.edges:
            if target == PACKAGE:
                climbs.append(f"{_where(name, line)}: {name} imports the top-level package")
                continue
            high, high_part = _layer(target)
            if high > low:
                climbs.append(f"{_where(name, line)}: {name} ({LAYERS[low][0]}) imports "
                              f"{target} ({LAYERS[high][0]})")
            elif high == low and low_part in ENGINE_ORDER and high_part in ENGINE_ORDER \
                    and ENGINE_ORDER[high_part] > ENGINE_ORDER[low_part]:
                climbs.append(f"{_where(name, line)}: {name} imports {target}, a later engine")
            for a, b in SIBLINGS:
                if {low_part, high_part} == {a, b}:
                    climbs.append(f"{_where(name, line)}: {name} imports {target}; "
                                  f"{a} and {b} meet only through a type below both")
    climbs = list(dict.fromkeys(climbs))
    assert not climbs, "imports that climb:\n" + "\n".join(climbs)


def test_no_text_about_how_it_was_made():
    hits = [f"{_where(name, i)}: {line.strip()}"
            for name, path in MODULES.items()
            for i, line in enumerate(path.read_text().splitlines(), 1) if FORBIDDEN_TEXT.search(line)]
    assert not hits, "text about how the package was made:\n" + "\n".join(hits)


def test_no_module_level_state_outside_the_registry():
    """An empty container bound at module level is state a test cannot reset: runtime.state holds it."""
    found = []
    for name, path in MODULES.items():
        if name == "overlapkit.runtime.state":
            continue
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            empty = isinstance(value, (ast.Dict, ast.Set, ast.List)) and not getattr(value, "keys", None) \
                and not getattr(value, "elts", None)
            empty = empty or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                              and value.func.id in ("dict", "set", "list") and not value.args and not value.keywords)
            if empty:
                found.append(_where(name, node.lineno))
    assert not found, "module-level mutable state outside runtime.state:\n" + "\n".join(found)


def test_no_function_rebinds_a_module_global():
    """`global x; x = ...` is module state by another spelling (a flag set once, the active recorder):
    runtime.state holds it, in a registry that names it."""
    found = [f"{_where(name, node.lineno)}: global {', '.join(node.names)}"
             for name, path in MODULES.items() if name != "overlapkit.runtime.state"
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]
    assert not found, "module globals rebound outside runtime.state:\n" + "\n".join(found)
