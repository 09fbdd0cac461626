"""The instructor edition's worked solutions (book/solutions/): one for every exercise of every
chapter, none left in the student chapters, and every code block runs (each checker call asserts
that the solution passes its checker)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("[01][0-9]-*.md"))
SOLUTIONS = ROOT / "book" / "solutions"


def exercises(chapter: Path) -> list[str]:
    return re.findall(r"^\*\*Exercise (\d+\.\d+) \(", chapter.read_text(), re.M)


def test_every_exercise_has_a_worked_solution_and_no_chapter_shows_one():
    assert {p.name for p in SOLUTIONS.glob("*.md")} == {c.name for c in CHAPTERS}
    total = 0
    for chapter in CHAPTERS:
        numbers = exercises(chapter)
        assert numbers, f"{chapter.name} has no exercises"
        solved = re.findall(r"^## Exercise (\d+\.\d+) ", (SOLUTIONS / chapter.name).read_text(), re.M)
        assert solved == numbers, f"{chapter.name}: exercises {numbers}, solutions {solved}"
        assert "{dropdown} Answer" not in chapter.read_text(), f"{chapter.name} shows an answer to students"
        total += len(numbers)
    assert total >= 49


@pytest.mark.parametrize("page", sorted(SOLUTIONS.glob("*.md")), ids=lambda p: p.stem)
def test_the_solutions_code_runs_and_passes_the_checkers(page, capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)
    namespace = {"__name__": f"solutions_{page.stem}"}
    for block in blocks:
        exec(compile(block, f"{page.name}", "exec"), namespace)
    checks = sum(block.count("assert check_") for block in blocks)
    numbers = exercises(ROOT / "book" / page.name)
    with_checker = [n for n in numbers if "check_" in _exercise_text(ROOT / "book" / page.name, n)]
    assert checks >= len(with_checker), f"{page.name}: {len(with_checker)} exercises have checkers, {checks} checked"


def _exercise_text(chapter: Path, number: str) -> str:
    text = chapter.read_text()
    start = text.index(f"**Exercise {number} (")
    end = text.find("**Exercise ", start + 10)
    return text[start:end if end > 0 else None]


def test_the_student_edition_leaves_the_solutions_out_and_the_instructor_edition_lists_them(tmp_path):
    import sys
    import yaml
    sys.path.insert(0, str(ROOT / "book" / "_scripts"))
    import stage

    for instructor in (False, True):
        out = tmp_path / str(instructor)
        import shutil
        shutil.copytree(ROOT / "book", out, ignore=stage.book_ignore(instructor))
        assert (out / "solutions").exists() == instructor
        assert (out / "01-moe-layer.md").exists()
    pages = sorted(p.stem for p in SOLUTIONS.glob("*.md"))
    toc = yaml.safe_load(stage.toc_with_solutions((ROOT / "_toc.yml").read_text(), pages))
    last = toc["parts"][-1]
    assert last["caption"].startswith("Solutions") and [c["file"] for c in last["chapters"]] == \
        [f"book/solutions/{p}" for p in pages]
    assert toc["parts"][:-1] == yaml.safe_load((ROOT / "_toc.yml").read_text())["parts"]
