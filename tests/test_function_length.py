"""Functions short enough to read on one screen or two: at most 80 lines in the library, 100
in the harness (docstring included), so that a long one is split when it is written, not later."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LIMITS = {"microsparse": 80, "microsparse_lab": 100}


def longer_than(limit: int, text: str, where: str) -> list[str]:
    """``where:line name (n lines)`` for every function in ``text`` longer than ``limit``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


@pytest.mark.parametrize("package", sorted(LIMITS))
def test_no_function_is_longer_than_its_package_allows(package: str) -> None:
    limit = LIMITS[package]
    long = []
    for path in sorted((SRC / package).rglob("*.py")):
        long += longer_than(limit, path.read_text(encoding="utf-8"), str(path.relative_to(SRC)))
    assert not long, f"longer than {limit} lines, split them: " + "; ".join(long)


def test_the_check_finds_a_long_function() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    text = f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}\n"
    assert longer_than(5, text, "a.py") == ["a.py:6 long (6 lines)"]
