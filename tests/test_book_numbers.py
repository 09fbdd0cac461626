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
