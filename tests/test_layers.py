"""The architecture, read from the imports: the library below, the harness above, one way.

``microsparse`` (the library) never imports ``microsparse_lab`` (the harness); the harness
imports the library's public names only (those in the ``__all__`` of a package of PUBLIC);
inside each,
every module belongs to a layer and imports only from its own layer or those below; no
module imports itself back through others; and every import of the project's modules sits at
the top of its file, where it can be seen (an import inside a function would hide a circle).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PROJECT = ("microsparse", "microsparse_lab")

LAYERS = [
    ["microsparse.errors", "microsparse.stats", "microsparse.layout", "microsparse.ranks"],
    ["microsparse.comm", "microsparse.feedback"],
    ["microsparse.sparsifiers"],
    ["microsparse.engine"],
    ["microsparse.options"],
    ["microsparse.reducer", "microsparse.ddp"],
    ["microsparse.fsdp", "microsparse.lightning", "microsparse"],
    ["microsparse_lab.methods", "microsparse_lab.arguments"],
    ["microsparse_lab.training", "microsparse_lab.reports"],
    ["microsparse_lab.bench"],
    ["microsparse_lab.cli", "microsparse_lab.__main__", "microsparse_lab"],
]
"""From the bottom up; a module belongs to the longest name listed that contains it."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PROJECT:
        for path in sorted((SRC / package).rglob("*.py")):
            parts = path.relative_to(SRC).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def imports(path: Path, text: str | None = None) -> Iterator[tuple[str, int, bool]]:
    """(module imported, line, at the top of the file?) for each import of the project in the
    file at ``path`` (or in ``text``, as if it were that file)."""
    tree = ast.parse(path.read_text(encoding="utf-8") if text is None else text)
    top = set(map(id, tree.body))
    package = ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this file is in
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from a.b import c`` imports the module a.b.c where c is one, else a.b
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PROJECT:
                yield target, node.lineno, id(node) in top


def layer(module: str) -> int:
    owners = [
        (len(name), index)
        for index, names in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    assert owners, f"{module} is in no layer of LAYERS: add it there"
    return max(owners)[1]


def graph() -> dict[str, set[str]]:
    return {name: {t for t, _, _ in imports(path) if t != name} for name, path in MODULES.items()}


PUBLIC = (
    "microsparse",
    "microsparse.comm",
    "microsparse.ddp",
    "microsparse.engine",
    "microsparse.feedback",
    "microsparse.fsdp",
    "microsparse.layout",
    "microsparse.lightning",
    "microsparse.options",
    "microsparse.sparsifiers",
    "microsparse.stats",
)
"""The library's public surface: these modules, and in each only the names of its ``__all__``."""


def public_names(module: str) -> set[str]:
    """The ``__all__`` of a module, read from its source (without importing it)."""
    for node in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{MODULES[module].relative_to(SRC)} has no __all__: give it one")


EXPORTS = {module: public_names(module) for module in PUBLIC}


def private_imports(path: Path, text: str | None = None) -> Iterator[str]:
    """Each import of the library in a harness file that goes past its public names, with
    file, line and the fix."""
    tree = ast.parse(path.read_text(encoding="utf-8") if text is None else text)
    where = path.relative_to(SRC)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "microsparse" and alias.name not in PUBLIC:
                    yield (
                        f"{where}:{node.lineno} imports the private module {alias.name}: "
                        f"{fix(alias.name)}"
                    )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("microsparse"):
            module = node.module or ""
            if module.split(".")[0] != "microsparse":
                continue  # microsparse_lab
            for alias in node.names:
                if module in PUBLIC and (
                    alias.name in EXPORTS[module] or f"{module}.{alias.name}" in PUBLIC
                ):
                    continue
                yield (
                    f"{where}:{node.lineno} imports {alias.name} from {module}, "
                    f"which is not one of its public names: {fix(alias.name)}"
                )


def fix(name: str) -> str:
    short = name.rsplit(".", 1)[-1]
    owners = sorted(m for m, names in EXPORTS.items() if short in names)
    if owners:
        return f"write `from {owners[0]} import {short}`"
    return (
        f"export {short} in the __all__ of a package of PUBLIC (saying so if it is for "
        "measuring only), or move it to the harness"
    )


def test_the_harness_imports_public_names_only() -> None:
    private = [
        problem
        for name, path in MODULES.items()
        if name.split(".")[0] == "microsparse_lab"
        for problem in private_imports(path)
    ]
    assert private == [], "\n".join(private)


def test_the_public_names_exist() -> None:
    """Every name in a public ``__all__`` is importable (a typo would let any import pass)."""
    import importlib

    for module in PUBLIC:
        if module == "microsparse.lightning":
            continue  # its names are built on first use, from whichever Lightning is installed
        missing = [n for n in EXPORTS[module] if not hasattr(importlib.import_module(module), n)]
        assert missing == [], f"{module}.__all__ names what it does not define: {missing}"


def test_the_check_sees_an_import_past_the_public_names() -> None:
    path = MODULES["microsparse_lab.bench.costmodel"]
    text = (
        "import microsparse.ddp\n"
        "import microsparse.comm.framing\n"
        "from microsparse import GradientReducer, ddp\n"
        "from microsparse.comm import Padded\n"
        "from microsparse.comm.collectives import all_reduce_bytes\n"
        "from microsparse.reducer import GradientReducer\n"
        "from microsparse.comm import check_agreement\n"
    )
    found = list(private_imports(path, text))
    assert [line.split(" ", 1)[0] for line in found] == [
        f"{path.relative_to(SRC)}:{n}" for n in (2, 5, 6, 7)
    ]
    assert "write `from microsparse.comm import all_reduce_bytes`" in found[1]
    assert "write `from microsparse import GradientReducer`" in found[2]
    assert "or move it to the harness" in found[3]


def test_the_library_never_imports_the_harness() -> None:
    upward = [
        f"{MODULES[name].relative_to(SRC)}:{line} imports {target}"
        for name in MODULES
        if name.split(".")[0] == "microsparse"
        for target, line, _ in imports(MODULES[name])
        if target.split(".")[0] == "microsparse_lab"
    ]
    assert upward == []


def test_every_import_goes_down_the_layers() -> None:
    upward = [
        f"{MODULES[name].relative_to(SRC)}:{line} imports {target} from a higher layer"
        for name in MODULES
        for target, line, _ in imports(MODULES[name])
        if layer(target) > layer(name)
    ]
    assert upward == []


def test_no_circle_of_imports() -> None:
    edges = graph()
    circles = [scc for scc in strongly_connected(edges) if len(scc) > 1]
    assert circles == []


def test_project_imports_sit_at_the_top_of_their_files() -> None:
    hidden = [
        f"{MODULES[name].relative_to(SRC)}:{line} imports {target} inside a function"
        for name in MODULES
        for target, line, at_top in imports(MODULES[name])
        if not at_top
    ]
    assert hidden == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_circle_finder_finds_circles(edges: dict[str, set[str]], expected: list) -> None:
    assert [sorted(s) for s in strongly_connected(edges) if len(s) > 1] == expected


def test_the_checks_see_an_import_inside_a_function() -> None:
    found = list(imports(MODULES["microsparse.engine.step"]))
    assert found and all(at_top for _, _, at_top in found)  # what the checks above read
    text = "import torch\nfrom .. import errors\n\ndef f():\n    from microsparse_lab import cli\n"
    assert list(imports(MODULES["microsparse.engine.step"], text)) == [
        ("microsparse.errors", 2, True),
        ("microsparse_lab.cli", 5, False),
    ]


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_library_imports_without_the_harness_dependencies() -> None:
    """``pip install microsparse`` brings torch only: every library module imports without
    numpy, tqdm or matplotlib (a subprocess in which importing them fails), and without
    torch's compiler, which only a compiled step needs."""
    library = sorted(name for name in MODULES if name.split(".")[0] == "microsparse")
    script = f"""
import importlib, importlib.abc, sys
BLOCKED = ("numpy", "tqdm", "matplotlib", "microsparse_lab")
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"no module named {{name!r}} (blocked: not installed)")
sys.meta_path.insert(0, Blocker())
for name in {library!r}:
    importlib.import_module(name)
print("imported", len({library!r}))
print("dynamo", "torch._dynamo" in sys.modules)  # a second of import, for torch.compile only
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"imported {len(library)}" in result.stdout
    assert "dynamo False" in result.stdout
