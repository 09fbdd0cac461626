"""The chapters' figures (book/_scripts/figures.py) and the chapters' openings and summaries.

A figure must draw from today's code, label its axes, keep all its text inside the image and at a
size readable at the page's width, and be shown by its chapter. Each chapter must open with its idea,
objectives, prerequisites, a reading time that matches its length and its notebooks' run times, and
close with a summary before its exercises.
"""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_scripts"))
import figures  # noqa: E402

CHAPTERS = sorted((ROOT / "book").glob("[01][0-9]-*.md"))
PAGES_WITH_FIGURES = CHAPTERS + [ROOT / "book" / "choosing-a-router.md"]  # every chapter, and the choosing page


@pytest.fixture(scope="module")
def drawn():
    plt = figures._plt()
    out = {name: function() for name, (function, _) in figures.FIGURES.items()}
    yield out
    for fig in out.values():
        plt.close(fig)


def texts_of(fig):
    for text in fig.findobj(match=lambda artist: hasattr(artist, "get_text") and hasattr(artist, "get_fontsize")):
        if text.get_visible() and text.get_text().strip():
            yield text


def test_every_chapter_has_exactly_the_figures_it_shows():
    shown = {}
    for page in PAGES_WITH_FIGURES:
        for name in re.findall(r"```\{figure\} figures/([\w-]+)\.png", page.read_text()):
            shown.setdefault(name, []).append(page.name)
    assert set(shown) == set(figures.FIGURES), "a figure is drawn but not shown, or shown but not drawn"
    for name, (_, page) in figures.FIGURES.items():
        assert shown[name] == [page], f"{name} should be shown by {page} only, is in {shown[name]}"
    assert {page for _, page in figures.FIGURES.values()} == {p.name for p in PAGES_WITH_FIGURES}


def test_figures_label_their_axes(drawn):
    for name, fig in drawn.items():
        for ax in fig.axes:
            if not ax.axison:
                continue
            assert ax.get_xlabel().strip() or not ax.get_xticklabels(), f"{name}: an axis has no x label"
            if ax.get_ylabel().strip() or not [t for t in ax.get_yticklabels() if t.get_text()]:
                continue
            # panels in a row may share the leftmost panel's y label
            row = [other for other in fig.axes if abs(other.get_position().y0 - ax.get_position().y0) < 0.02]
            assert any(other.get_ylabel().strip() for other in row), f"{name}: a row of panels has no y label"


def test_figure_text_is_readable_at_page_width_and_inside_the_image(drawn):
    for name, fig in drawn.items():
        width, _ = fig.get_size_inches()
        assert width <= figures.WIDTH + 1e-9, f"{name} is {width} in wide: the page would shrink its text"
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for text in texts_of(fig):
            assert text.get_fontsize() >= figures.FONT - 1, f"{name}: {text.get_text()!r} is set too small"
        # everything drawn (titles, labels, tick labels in view) lies inside the saved image
        drawn_box, size = fig.get_tightbbox(renderer), fig.get_size_inches()
        assert (drawn_box.x0 >= -0.01 and drawn_box.y0 >= -0.01 and drawn_box.x1 <= size[0] + 0.01
                and drawn_box.y1 <= size[1] + 0.01), f"{name}: some text runs off the image ({drawn_box})"


def test_draw_writes_every_figure(tmp_path):
    written = figures.draw(tmp_path, ["ch07-ksubset-lattice", "ch06-selection-lp"])
    assert [p.name for p in written] == ["ch07-ksubset-lattice.png", "ch06-selection-lp.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in written)
    with pytest.raises(SystemExit, match="unknown figure"):
        figures.draw(tmp_path, ["ch99-nothing"])


def test_the_figures_show_what_their_captions_say():
    """The facts each caption states, recomputed from the figures' own examples."""
    import torch
    from minimoe import ops
    logits = figures._logits()
    T, E = logits.shape
    # ch. 1: capacity 3, and some tokens are dropped
    router, x = figures._router("softmax_topk", logits, k=1, capacity_factor=1.0)
    routing = router(x)
    assert routing.capacity == 3 and 0 < routing.stats["drop_rate"] < 1
    # ch. 2: every plan balanced; the coldest nearly hard
    for eps in (1.0, 0.3, 0.03):
        plan = ops.sinkhorn(logits, eps, row_sums=1.0, col_sums=T / E, max_iter=5000, tol=1e-10)
        torch.testing.assert_close(plan.sum(1), torch.ones(T, dtype=plan.dtype), atol=1e-6, rtol=0)
        torch.testing.assert_close(plan.sum(0), torch.full((E,), T / E, dtype=plan.dtype), atol=1e-6, rtol=0)
    assert plan.max(1).values.min() > 0.9
    # ch. 6: global top-c is strictly better than both constrained selections on this example
    scores = torch.sigmoid(logits)
    top = (scores * ops.global_topc(scores, T)).sum()
    assert top > scores.max(1).values.sum() and top > scores.topk(T // E, dim=0).values.sum()


def words(text):
    return len(re.sub(r"```.*?```", " ", text, flags=re.S).split())


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_opens_with_its_idea_and_closes_with_a_summary(chapter):
    text = chapter.read_text()
    body = text.split("\n# ", 1)[1]
    assert body.split("\n", 2)[2].lstrip().startswith(":::{admonition} In this chapter"), \
        f"{chapter.name}: the 'In this chapter' box must come right after the title"
    box = body.split(":::{admonition} In this chapter", 1)[1].split("\n:::\n", 1)[0]
    for part in ("**The idea.**", "**You will learn to**", "**Prerequisites.**", "**Reading time:**", "**Notebooks:**"):
        assert part in box, f"{chapter.name}: the opening box has no {part}"
    assert len(re.findall(r"^\* ", box, re.M)) >= 3, f"{chapter.name}: list at least three objectives"
    minutes = int(re.search(r"\*\*Reading time:\*\* about (\d+) minutes", box).group(1))
    expected = words(text) / 150          # a technical text at 150 words a minute
    assert 0.75 * expected <= minutes <= 1.25 * expected + 5, \
        f"{chapter.name}: reading time {minutes} min, but {words(text)} words read in about {expected:.0f}"
    summary = re.search(r":::\{admonition\} Summary\n:class: important\n(.*?)\n:::\n", text, re.S)
    assert summary and len(re.findall(r"^\* ", summary.group(1), re.M)) >= 3, f"{chapter.name}: no summary box"
    exercises = text.find("## Exercises")
    assert exercises < 0 or summary.start() < exercises, f"{chapter.name}: the summary goes before the exercises"


def test_chapters_name_their_notebooks_with_a_run_time():
    from book_map import CHAPTERS as MAP
    for number, (_, _, notebooks, _) in MAP.items():
        chapter = next(c for c in CHAPTERS if c.name.startswith(f"{number:02d}-"))
        box = chapter.read_text().split(":::{admonition} In this chapter", 1)[1].split("\n:::\n", 1)[0]
        named = re.findall(r"\{doc\}`\.\./notebooks/(\d\d[a-z]?)-[\w-]+` \((under 10 seconds|about \d+ seconds|about \d+ minutes)\)", box)
        assert [n for n, _ in named] == notebooks, f"{chapter.name} names notebooks {named}, the map {notebooks}"


def test_each_notebook_states_its_run_time_and_its_chapter_quotes_the_same():
    import jupytext
    stated = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = next(c for c in jupytext.read(path).cells if c.cell_type == "markdown")
        match = re.search(r"\*Run time:\* (under 10 seconds|about \d+ seconds) at CPU scale", first.source)
        assert match, f"{path.name}: the first cell must state the run time at CPU scale"
        stated[path.stem] = match.group(1)
    for chapter in CHAPTERS:
        box = chapter.read_text().split(":::{admonition} In this chapter", 1)[1].split("\n:::\n", 1)[0]
        for notebook, time in re.findall(r"\{doc\}`\.\./notebooks/([\w-]+)` \(([^)]*)\)", box):
            assert time == stated[notebook], f"{chapter.name} says {notebook} takes {time}, the notebook {stated[notebook]}"
