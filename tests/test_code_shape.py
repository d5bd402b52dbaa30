"""The library's functions and classes stay small enough to extend: no function over 80 lines
(ruff's C901 holds their cyclomatic complexity to 25, pyproject.toml), no class over 400. Tests
and benchmarks aside."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("vlmcompile", "passes", "cost_models")
MAX_LINES = 80
MAX_CLASS_LINES = 400


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_library_function_is_over_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for folder in LIBRARY
        for path in sorted((ROOT / folder).rglob("*.py"))
        for fn in _functions(path)
        if fn.end_lineno - fn.lineno + 1 > MAX_LINES
    ]
    assert not long, "split these along their phases:\n" + "\n".join(long)


def test_no_library_class_is_over_400_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for folder in LIBRARY
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, "give these parts of their work to objects of their own:\n" + "\n".join(long)


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert [fn.end_lineno - fn.lineno + 1 for fn in _functions(tmp_path / "m.py")] == [MAX_LINES + 1]
