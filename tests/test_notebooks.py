"""Notebook hygiene: outputs stripped, jupytext pair in sync, the install cell and SCALE switch."""
import re
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
    # GPU scale is chosen explicitly (MINIMOE_SCALE=gpu or the SCALE line), never because CUDA is present
    assert any('SCALE = os.environ.get("MINIMOE_SCALE", "cpu")' in c for c in code), "every notebook needs the SCALE switch"
    assert not any(re.search(r"^SCALE =.*cuda", c, re.M) for c in code), "SCALE must not follow CUDA's presence"


def test_every_notebook_is_in_the_toc():
    toc = (ROOT / "_toc.yml").read_text()
    for path in NOTEBOOKS:
        assert f"notebooks/{path.stem}" in toc


def from_scratch_cells():
    """(notebook, source of the from-scratch cell, source of the code cell after it) for every code cell
    tagged "from-scratch" (jupytext: ``# %% tags=["from-scratch"]``)."""
    found = []
    for path in NOTEBOOKS:
        code = [c for c in jupytext.read(path).cells if c.cell_type == "code"]
        for i, cell in enumerate(code):
            if "from-scratch" in cell.metadata.get("tags", []):
                found.append((path.name, cell.source, code[i + 1].source if i + 1 < len(code) else ""))
    return found


def test_every_registered_router_is_built_from_scratch_and_checked_against_the_package():
    """Each router has a plain-PyTorch version in its chapter's notebook (at most 30 lines, no minimoe in
    the cell), and the next cell asserts that it equals the package's router on a seeded example."""
    from minimoe.routers import available
    checked = set()
    cells = from_scratch_cells()
    assert cells, "no cell is tagged from-scratch"
    for name, source, check in cells:
        lines = [line for line in source.splitlines() if line.strip()]
        assert len(lines) <= 30, f"{name}: a from-scratch cell has {len(lines)} lines (at most 30)"
        assert "minimoe" not in source, f"{name}: a from-scratch cell uses minimoe"
        assert "assert" in check, f"{name}: the cell after a from-scratch cell must assert it equals the package"
        checked |= set(re.findall(r'"([a-z_]+)"', check)) & set(available())
    assert checked == set(available()), f"routers with no from-scratch version: {sorted(set(available()) - checked)}"


def test_cells_are_short_and_a_long_one_says_why():
    """No code cell over 40 lines, except at most three in the whole book, each after a markdown cell that
    says why it is longer than a cell should be."""
    long_cells = []
    for path in NOTEBOOKS:
        cells = jupytext.read(path).cells
        for i, cell in enumerate(cells):
            lines = [line for line in cell.source.splitlines() if line.strip()]
            if cell.cell_type == "code" and len(lines) > 40:
                long_cells.append(path.name)
                before = next((c.source for c in reversed(cells[:i]) if c.cell_type == "markdown"), "")
                assert "longer than a cell should be" in before, f"{path.name}: a {len(lines)}-line cell with no reason"
    assert len(long_cells) <= 3, f"{len(long_cells)} code cells over 40 lines: {long_cells}"
