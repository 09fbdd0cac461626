"""The numbers of chapter 9 are the committed reference study's: the chapter quotes the tables that
minimoe.experiments.report writes from minimoe/experiments/results/reference-cpu, verbatim."""
from pathlib import Path

from minimoe.experiments import read_results, report

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "book" / "09-what-the-routers-teach-us.md"
REFERENCE = ROOT / "minimoe" / "experiments" / "results" / "reference-cpu"


def test_chapter_9_tables_are_the_committed_study():
    rows = read_results(REFERENCE)
    text = CHAPTER.read_text()
    for name, table in (("results", report.results_table(rows)), ("claims", report.claims_table(rows))):
        assert table in text, (f"chapter 9's {name} table is not the committed study's; paste the output of "
                               f"`python -m minimoe.experiments show --markdown {REFERENCE.relative_to(ROOT)}`")


def test_chapter_9_says_which_commit_made_the_study_and_whether_the_code_moved_since():
    """The reproducibility contract's third part: the chapter names the study's commit, and says that
    the routing code has changed since exactly when git says so."""
    from minimoe.experiments.runner import study_origin

    chapter = (ROOT / "book" / "09-what-the-routers-teach-us.md").read_text()
    origin = study_origin(REFERENCE)
    assert f"commit `{origin['commit'][:7]}` on {origin['date']}" in chapter
    if origin["changed"] is None:
        return  # no git history in this copy: nothing to compare
    says_changed = "The routing code has changed since" in chapter
    assert says_changed == bool(origin["changed"]), (origin["sentence"], origin["changed"][:5])


def test_the_choosing_page_is_the_committed_study_and_is_linked():
    """The table of "Choosing a router" is report.choosing_table of the committed study, verbatim; the
    page is in the table of contents and linked from the introduction and chapter 9."""
    page = (ROOT / "book" / "choosing-a-router.md").read_text()
    table = report.choosing_table(read_results(REFERENCE))
    assert table in page, "paste report.choosing_table(read_results(REFERENCE)) into book/choosing-a-router.md"
    assert "book/choosing-a-router" in (ROOT / "_toc.yml").read_text()
    for linking in ("intro.md", "09-what-the-routers-teach-us.md"):
        assert "{doc}`choosing-a-router`" in (ROOT / "book" / linking).read_text(), linking


def test_every_chapter_points_to_the_choosing_page():
    for chapter in sorted((ROOT / "book").glob("[01][0-9]-*.md")):
        assert "{doc}`choosing-a-router`" in chapter.read_text(), chapter.name
