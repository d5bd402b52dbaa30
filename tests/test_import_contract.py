"""Imports point one way: ir <- cost_models <- sim <- planning <- passes <- compiler <- cli, demo, train_command
(graph and runtime read ir only; models read ir; families read ir, data and models). Planning sits above the simulator: a policy's
result is its plan simulated, and the simulator knows nothing of how plans are made.

Every import of a vlmcompile module is read from the source (inside functions and under
TYPE_CHECKING too), so a shortcut taken in a function body breaks this test like one at the top.
"""

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "vlmcompile": ROOT / "vlmcompile",
    "vlmcompile.passes": ROOT / "passes",
    "vlmcompile.cost_models": ROOT / "cost_models",
}

TOP = {
    "vlmcompile",
    "vlmcompile.compiler",
    "vlmcompile.compiled_pipeline",
    "vlmcompile.pass_runner",
    "vlmcompile.cli",
    "vlmcompile.demo",
    "vlmcompile.train_command",
    "vlmcompile.model_source",
}
ALLOWED = {
    "ir": {"ir"},
    "cost_models": {"ir", "cost_models"},
    "graph": {"ir", "graph"},
    "planning": {"ir", "cost_models", "sim", "planning"},
    "sim": {"ir", "cost_models", "sim"},
    "runtime": {"ir", "runtime"},
    "models": {"ir", "models"},
    "data": {"ir", "data"},
    "families": {"ir", "data", "models", "families"},
    "passes": {"ir", "cost_models", "graph", "planning", "sim", "runtime", "data", "families", "passes"},
    "top": {
        "ir",
        "cost_models",
        "graph",
        "planning",
        "sim",
        "runtime",
        "models",
        "data",
        "families",
        "passes",
        "top",
    },
}
COMPILER_USERS = {"vlmcompile", "vlmcompile.cli", "vlmcompile.demo", "vlmcompile.train_command"}
"""The package's own __init__ (``vlmcompile.compile``), the CLI, the demo and the train command."""


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "vlmcompile" and parts and parts[0] in ("passes", "cost_models"):
                continue  # not there: they install from the top-level folders
            out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    if module in TOP:
        return "top"
    return module.split(".")[1]


def _imports(path: Path) -> set[str]:
    """Our modules ``path`` imports: ``from a.b import c`` counts a.b.c if that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vlmcompile":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "vlmcompile"}
    return found


@functools.cache
def _graph() -> nx.DiGraph:
    """Module -> the modules it imports (built when a test asks: parsing every source takes 2 s,
    which each CI worker's collection would pay)."""
    graph = nx.DiGraph()
    for name, path in MODULES.items():
        graph.add_node(name)
        for target in _imports(path):
            graph.add_edge(name, target)
    return graph


def test_the_sources_are_all_found():
    assert {
        "vlmcompile.ir.plan",
        "vlmcompile.passes.graph.capture",
        "vlmcompile.cost_models.memory",
        "vlmcompile.cli",
    } <= set(MODULES)
    unknown = sorted(t for _, t in _graph().edges if t not in MODULES)
    assert not unknown, f"imports of modules that do not exist: {unknown}"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer):
    wrong = sorted(
        f"{a} imports {b}"
        for a, b in _graph().edges
        if _layer(a) == layer and _layer(b) not in ALLOWED[layer]
    )
    assert not wrong, "\n".join(wrong)


def test_only_the_cli_the_demo_and_the_train_command_import_the_compiler():
    users = {a for a, b in _graph().edges if b == "vlmcompile.compiler"}
    assert users <= COMPILER_USERS, sorted(users - COMPILER_USERS)


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, cycles[:5]


def test_the_contract_catches_a_wrong_import(tmp_path):
    """The reader sees an import inside a function as well as one at the top."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from vlmcompile.sim.simulator import simulate\n    import vlmcompile.compiler\n"
    )
    assert _imports(bad) == {"vlmcompile.sim.simulator", "vlmcompile.compiler"}


def test_the_tour_and_the_passes_package_name_every_pass():
    import vlmcompile.passes

    root = Path(__file__).resolve().parent.parent
    files = sorted(
        p.relative_to(root / "passes").with_suffix("").as_posix()
        for p in (root / "passes").rglob("*.py")
        if p.stem != "__init__"
    )
    readme = root.joinpath("README.md").read_text()
    tour = next(line for line in readme.splitlines() if line.startswith("| `passes/` |"))
    for f in files:
        *folders, name = f.split("/")
        named = all(f"`{folder}/`" in tour for folder in folders) and f"`{name}`" in tour
        assert named, f"README's passes/ row does not name {f}"
    assert [f for f in files if f"{f}.py" not in vlmcompile.passes.__doc__] == []


def _named_in(doc: str, name: str) -> bool:
    return f"``{name}``" in doc or f"{name}.py" in doc or f"{name}/" in doc


def test_every_packages_tour_names_all_its_modules():
    """Each package's ``__init__`` docstring names every module and sub-package in it (or an
    enclosing package's names it by its path, as ``passes`` does its folders')."""
    missing = []
    for root in SOURCES.values():
        for init in root.rglob("__init__.py"):
            if root == ROOT / "vlmcompile" and init.parent.relative_to(root).parts[:1] in (
                ("passes",),
                ("cost_models",),
            ):
                continue
            folder = init.parent
            children = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
            children += [p.name for p in folder.iterdir() if (p / "__init__.py").exists()]
            docs = [ast.get_docstring(ast.parse(init.read_text())) or ""]
            enclosing = [
                (a, folder.relative_to(a).as_posix()) for a in folder.parents if (a / "__init__.py").exists()
            ]
            for name in children:
                named = _named_in(docs[0], name) or any(
                    f"{rel}/{name}.py"
                    in (ast.get_docstring(ast.parse((a / "__init__.py").read_text())) or "")
                    for a, rel in enclosing
                )
                if not named:
                    missing.append(f"{folder.relative_to(ROOT)}/__init__.py does not name {name}")
    assert not missing, "\n".join(missing)
