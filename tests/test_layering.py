"""The package's layering (DESIGN.md): ops <- routing <- routers <- layers <- models / parallel <-
experiments <- exercises (the checkers compare a reader's code with any part of the package, the
experiments' statistics included). Nothing imports upward: a router never imports the layer, an op never imports a router.
Read from the source (every import statement, including ones inside functions), so a lazy import that
runs back up the package is caught too."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minimoe"
# each layer, and the layers it may import (besides itself)
LEVEL = {"ops": 0, "routing": 1, "metrics": 1, "losses": 1, "routers": 2, "layers": 3, "models": 4,
         "parallel": 4, "data": 4, "train": 4, "experiments": 5, "exercises": 6, "hf": 6}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "minimoe" else None


def imports(source: str, module: str, is_package: bool = False):
    """The absolute names of the modules that ``source`` (the text of ``module``) imports."""
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target
            if not node.module:  # `from . import losses`
                yield from (f"{target}.{alias.name}" for alias in node.names)


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    own = module.split(".")[1]
    return [target for target in imports(source, module, is_package)
            if layer_of(target) in LEVEL and LEVEL[layer_of(target)] > LEVEL[own]]


FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_no_module_imports_upward(path):
    own = path.relative_to(PACKAGE).with_suffix("").parts[0]
    if own == "__init__":
        return  # the top-level package re-exports everything
    module = "minimoe." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    upward = upward_imports(path.read_text(), module, path.name == "__init__.py")
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports upward: {upward}"


def test_the_check_can_fail():
    """The arrow the routers used to break (usmoe.py imported MoELayer for reroute), written the ways a
    module can write it: caught each time; the same import from the models is allowed."""
    for source in ("from ..layers import MoELayer\n", "def f():\n    from ..layers import MoELayer\n",
                   "import minimoe.layers\n", "from .. import layers\n"):
        assert upward_imports(source, "minimoe.routers.usmoe"), source
    assert not upward_imports("from ..layers import MoELayer\n", "minimoe.models.blocks")
    assert not upward_imports("from ..ops import sinkhorn\n", "minimoe.routers.sinkhorn")


def private_imports(source: str) -> list[str]:
    """``from M import _name`` where ``_name`` is private to M (not a dunder): what a module or a
    notebook must not reach for. Package-internal helper modules (``minimoe.ops._checks``) may be
    imported; the names inside them are public to the package."""
    return [f"line {node.lineno}: from {node.module or '.'} import {alias.name}"
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


NOTEBOOKS = sorted((PACKAGE.parent / "notebooks").glob("[0-9]*.py"))


@pytest.mark.parametrize("path", FILES + NOTEBOOKS, ids=[str(p.relative_to(PACKAGE.parent)) for p in FILES + NOTEBOOKS])
def test_no_module_or_notebook_imports_a_private_name(path):
    assert not private_imports(path.read_text()), private_imports(path.read_text())


def test_the_private_name_check_can_fail():
    assert private_imports("from ..ops.allocation import _token_choice_allocation\n")
    assert private_imports("def f():\n    from .stats import by_seed, _common\n")
    assert not private_imports("from ..ops._checks import check_int\nfrom . import __version__\n")
