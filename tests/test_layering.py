"""The package's layers, read from the source: no import circles, no import from a layer above.

The import graph of ``pybmoe`` is built from the source alone (no module is imported): every
``.py`` file under ``pybmoe/`` is parsed, and every ``import``/``from ... import`` in it, at the
top or inside a function, relative or absolute, becomes an edge to the module it names (to
``pkg.name`` when that is a module of the package, else to ``pkg``). Importing ``a.b.c`` is an
edge to ``a.b.c`` alone: the parent packages it initialises on the way are not edges (each
package ``__init__`` only re-exports from its own modules). Imports by name at run time
(``importlib``) are not seen: the CLI's verb table and ``models/archs/__init__.py`` use them, both
within their own layer.

The layers (docs/architecture.md), top to bottom::

    cli                 rank 4   pybmoe.cli (and the root package pybmoe/__init__.py, its facade)
    bench               rank 3   pybmoe.bench
    routing | engine    rank 2   siblings: neither imports the other
    models  | build     rank 1   siblings: models may import build (the pinned tree's vocab), not back

A module may import its own layer and any layer of a lower rank; between siblings of one rank
only the pairs in :data:`SIBLING_EDGES` are allowed. What needs both routing and engine (the
demo's ``--route-replay granite``) is put together above them, in the CLI.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "pybmoe"

#: Rank of each layer (a higher rank may import a lower one).
RANKS = {
    "pybmoe": 4,            # the root package: __version__ and the lazy pybmoe.Llama facade
    "pybmoe.cli": 4,
    "pybmoe.bench": 3,
    "pybmoe.routing": 2,
    "pybmoe.engine": 2,
    "pybmoe.models": 1,
    "pybmoe.build": 1,
}
#: The only imports allowed between different layers of one rank.
SIBLING_EDGES = {("pybmoe.models", "pybmoe.build")}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its ``__init__``)."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (and those its ``__getattr__`` compares with)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, anywhere in its body. Fails on an
    import of a module the package does not have, or of a name its module does not define."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def resolve(mod: str, attr: str | None = None) -> str:
        assert mod in modules, f"{name} ({path}) imports {mod}, which is not a module of the package"
        assert attr is None or attr in _defined(modules[mod]), \
            f"{name} ({path}) imports {attr} from {mod}, which neither defines it nor has a module of that name"
        return mod

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "pybmoe" or a.name.startswith("pybmoe."):
                    targets.add(resolve(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not (mod == "pybmoe" or mod.startswith("pybmoe.")):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                targets.add(sub if sub in modules else resolve(mod, a.name))
    targets.discard(name)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(mod: str) -> str:
    """The layer a module belongs to: its first two name parts (``pybmoe`` for the root)."""
    return ".".join(mod.split(".")[:2])


def test_every_module_is_in_a_layer():
    for mod in _modules():
        assert _layer(mod) in RANKS, f"{mod} is in no layer of RANKS; add its subpackage to the table"


def test_the_graph_sees_the_imports():
    """A sanity check of the parser on imports known to exist (relative, absolute, function-local)."""
    g = _graph()
    assert "pybmoe.engine.binaries" in g["pybmoe.engine"]           # from .binaries import ...
    assert "pybmoe.build.vendor" in g["pybmoe.models.writer"]       # function-local: from ..build import vendor
    assert "pybmoe.models.writer" in g["pybmoe.models.archs.gemma4"]  # from pybmoe.models import writer as models
    assert "pybmoe.routing.sim" in g["pybmoe.bench.plot"]           # function-local: from ..routing.sim import ...
    assert "pybmoe.engine.bindings" in g["pybmoe"]                  # the lazy pybmoe.Llama


def test_no_import_circles():
    g = _graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_from_a_layer_above():
    bad = []
    for mod, targets in _graph().items():
        src = _layer(mod)
        for t in sorted(targets):
            dst = _layer(t)
            if src == dst:
                continue
            if RANKS[dst] > RANKS[src]:
                bad.append(f"{mod} (rank {RANKS[src]}) imports {t} (rank {RANKS[dst]}): a layer above")
            elif RANKS[dst] == RANKS[src] and (src, dst) not in SIBLING_EDGES and src != "pybmoe" and dst != "pybmoe":
                bad.append(f"{mod} imports {t}: siblings of rank {RANKS[src]} ({src}, {dst}) do not import each other")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("mod", [m for m in _modules() if _layer(m) not in ("pybmoe.cli", "pybmoe")])
def test_library_modules_have_no_command_line(mod):
    """Argument parsing, ``main(argv)`` and ``if __name__ == "__main__"`` live in pybmoe/cli/ only."""
    path = _modules()[mod]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert all(a.name != "argparse" for a in node.names), f"{mod} imports argparse"
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            pytest.fail(f"{mod} has an `if __name__ == ...` block (line {node.lineno}): scripts live in pybmoe/cli/")
    mains = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert not mains, f"{mod} defines main(): a CLI entry point, which belongs in pybmoe/cli/"
