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


def test_the_cost_page_quotes_the_committed_router_benchmark():
    """book/performance.md's table of router prices is the "in training" column of the committed full
    benchmark run it names, at E = 64 and E = 8."""
    import re
    page = (ROOT / "book" / "performance.md").read_text()
    name = re.search(r"`benchmarks/results/([\w-]+\.txt)`, the column \"in training\"", page).group(1)
    text = (ROOT / "benchmarks" / "results" / name).read_text()
    sections = re.findall(r"Routing overhead of every router, training mode, one group of T=4096 tokens, E=(\d+),.*?\n(.*?)\n\n",
                          text, re.S)
    committed = {}
    for experts, body in sections:
        for line in body.splitlines():
            fields = line.split()
            if fields and fields[0].isidentifier() and fields[-1].endswith("x") and len(fields) == 7:
                committed[fields[0], int(experts)] = fields[-1]
            elif line.strip().startswith("soft_moe floor"):
                committed["soft_moe", int(experts)] = re.search(r"in training ([\d.]+x)", line).group(1)
    rows = re.findall(r"^\| `(\w+)` \| ([\d.]+x) \| ([\d.]+x) \|", page, re.M)
    assert len(rows) == 15
    for router, at64, at8 in rows:
        assert (at64, at8) == (committed[router, 64], committed[router, 8]), router


def test_the_capacity_sentence_on_vision_has_the_sign_of_its_comparison():
    """Chapter 9: 'without the capacity minus with it' on vision is the paired difference
    softmax_topk_dropless - softmax_topk, and chapter 4 quotes the opposite difference."""
    from minimoe.experiments import claims, stats
    metric, _ = claims.headline("vision")
    values = stats.by_seed(read_results(REFERENCE), "vision", metric)
    seeds = sorted(set(values["softmax_topk_dropless"]) & set(values["softmax_topk"]))
    d = stats.paired([values["softmax_topk_dropless"][s] for s in seeds], [values["softmax_topk"][s] for s in seeds])
    chapter9 = (ROOT / "book" / "09-what-the-routers-teach-us.md").read_text()
    chapter4 = (ROOT / "book" / "04-six-routers.md").read_text()
    assert f"without the capacity minus with it: ${d.mean:+.4f} \\pm {d.half_width:.4f}$" in chapter9
    assert f"capacity minus without: ${-d.mean:+.4f} \\pm {d.half_width:.4f}$" in chapter4


def test_every_chapter_quotes_its_claims_from_the_committed_study():
    """Each chapter's "In the reference study" section holds the rows of chapter 9's claims table for
    the claims it discusses (report.claims_table(rows, section=...), Holm over the whole table),
    verbatim: the numbers its prose reads."""
    import re
    from minimoe.experiments import claims

    rows = read_results(REFERENCE)
    for section in sorted({claim.section for claim in claims.CLAIMS}):
        chapter = next(p for p in sorted((ROOT / "book").glob("*.md")) if f"({section})=" in p.read_text())
        table = report.claims_table(rows, section=section)
        assert table in chapter.read_text(), (f"{chapter.name}: paste report.claims_table(read_results(REFERENCE), "
                                              f"section={section!r}) into its section ({section})")
        assert re.search(r"\| \*\*(holds|reversed)\*\*|\| tie \||\| not shown \|", table)


def test_chapter_9_quotes_the_baselines_tables():
    rows = read_results(REFERENCE)
    text = CHAPTER.read_text()
    for task in ("lm", "clustered", "vision"):
        assert report.baselines_table(rows, task) in text, f"paste report.baselines_table(rows, {task!r}) into chapter 9"


def test_no_page_keeps_a_placeholder():
    """Numbers and tables to fill are written {{LIKE_THIS}} while a study is rerun
    and filled from the study once it is done; none may reach the book."""
    import re
    left = {page.name: re.findall(r"\{\{[A-Z_]+[^}]*\}\}", page.read_text())
            for page in [*sorted((ROOT / "book").rglob("*.md")), ROOT / "README.md"]}
    assert not {name: found for name, found in left.items() if found}
