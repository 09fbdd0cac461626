"""Notebook hygiene: outputs stripped, jupytext pair in sync, the install cell and SCALE switch."""
from pathlib import Path

import jupytext
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_stripped(path):
    nb = jupytext.read(path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs (make sync)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_jupytext_pair_in_sync(path):
    pair = path.with_suffix(".py")
    assert pair.exists(), f"{path.name} has no py:percent pair"
    a, b = jupytext.read(path), jupytext.read(pair)
    assert [(c.cell_type, c.source) for c in a.cells] == [(c.cell_type, c.source) for c in b.cells], (
        f"{path.name} and {pair.name} differ: run `make sync`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_and_scale_switch(path):
    nb = jupytext.read(path)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    assert "find_spec(\"minimoe\")" in code[0] and f"git+{repo}" in code[0], "first cell must install minimoe"
    assert any('SCALE = os.environ.get("MINIMOE_SCALE") or ("gpu" if torch.cuda.is_available() else "cpu")' in c
               for c in code), "every notebook needs the SCALE switch"


def test_every_notebook_is_in_the_toc():
    toc = (ROOT / "_toc.yml").read_text()
    for path in NOTEBOOKS:
        assert f"notebooks/{path.stem}" in toc
