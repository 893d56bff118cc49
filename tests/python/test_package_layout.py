"""strata.torch's shape, checked from its source (docs/architecture.md, "strata.torch"): no
import circle among its modules, no module reading another object's private attributes, no
file over the size one reader holds in mind, and the C++ module called from one place."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "strata" / "torch"
MOST_LINES = 460


def modules() -> dict[str, ast.Module]:
    return {f.stem: ast.parse(f.read_text(), str(f)) for f in sorted(PACKAGE.glob("*.py"))}


def runtime_imports(tree: ast.Module) -> set[str]:
    """The strata.torch modules `tree` imports when it runs (not under TYPE_CHECKING)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and sub.module:
                if sub.module == "strata.torch":
                    found.update(alias.name for alias in sub.names)
                elif sub.module.startswith("strata.torch."):
                    found.add(sub.module.split(".")[2])
    return found


def test_no_import_circle():
    graph = {name: runtime_imports(tree) for name, tree in modules().items()}
    graph.pop("__init__")  # The package's face imports everything and nothing imports it.

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import circle: " + " -> ".join(path + [name])
        for imported in sorted(graph.get(name, ())):
            visit(imported, path + [name])

    for name in graph:
        visit(name, [])


# What torch offers under an underscore and every hook library reads: a tensor's version
# counter and a module's own parameters.
TORCH_ATTRIBUTES = {"_version", "_parameters"}


def test_no_module_reads_another_objects_private_attributes():
    # `self._x`, `cls._x` and a module's own names are a module's business; `other._x` is not
    # (torch's own private API, torch._C, is torch's to offer).
    offenders = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or node.attr in TORCH_ATTRIBUTES:
                continue
            owner = ast.unparse(node.value)
            if owner in ("self", "cls", "super()") or owner.split(".")[0] == "torch":
                continue
            # One optimizer closing another (the same class, optimizer.py) is its own business.
            if name == "optimizer" and owner == "previous" and node.attr == "_body":
                continue
            # Module members of this package named with an underscore are modules, not
            # attributes.
            if owner in ("strata", "strata.torch") or owner.startswith("_"):
                continue
            offenders.append(f"{name}.py:{node.lineno}: {owner}.{node.attr}")
    assert not offenders, offenders


def test_no_file_is_too_long_to_read_whole():
    long = {f.name: n for f in PACKAGE.glob("*.py")
            if (n := len(f.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_only_the_native_module_calls_the_cpp_module():
    callers = sorted(name for name, tree in modules().items()
                     if any(isinstance(n, ast.ImportFrom) and n.module == "strata"
                            and any(a.name == "_strata" for a in n.names)
                            for n in ast.walk(tree)))
    assert callers == ["_native"], callers
