"""Render book/coverage.yml (every result: statement, proof, code, tests, cells) as the appendix page.

    python book/_scripts/coverage_page.py            # prints the page
    python book/_scripts/coverage_page.py --figure   # also writes book/_static/coverage.png

`stage.py book` writes the page to _build/src/book/coverage.md; tests/test_book_references.py
checks that everything the list names exists.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "book" / "coverage.yml"

PAPER_NAMES = {
    "liu2024routers": "Liu et al., Routers in Vision MoE",
    "nguyen2026ssr": "Nguyen et al., Selective Sinkhorn Routing",
    "kool2021unbiased": "Kool et al., unbiased balanced assignments",
    "do2025usmoe": "Do et al., USMoE",
    "zhao2026probmoe": "Zhao et al., ProbMoE",
    "book": "the book's own results",
}


def load(path: Path = LIST) -> list[dict]:
    return yaml.safe_load(path.read_text())["results"]


def paper_key(entry: dict) -> str:
    key = str(entry.get("paper", "book")).split()[0]
    return key if key in PAPER_NAMES else "book"


def chapter_of(entry: dict) -> int:
    match = re.match(r"ch(\d+)-", entry["statement"])
    return int(match.group(1)) if match else 0


def _proof(entry: dict) -> str:
    proof = entry["proof"]
    if proof == "proved":
        return "proved"
    keys = ",".join(proof["cited"].split())
    return f"cited {{cite:p}}`{keys}`: {proof['why']}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(entries: list[dict]) -> str:
    lines = [
        "(coverage)=",
        "# What is proved, where it runs",
        "",
        "Every result of the five papers, and every numbered result of this book, with where it is",
        "stated, how it is established (proved here, or cited with the reason), the `minimoe` code that",
        "implements it, the tests that check it against an independent oracle, and the notebook cells",
        "that check it in front of you. The page is generated from one machine-readable list,",
        "`book/coverage.yml`; the test `tests/test_book_references.py` fails when an entry names a",
        "label, function, test or cell that does not exist, when a proof it claims is missing, or when a",
        "notebook cell it names asserts nothing.",
        "",
        "| source | results | proved | cited | with a test | with a notebook check |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    by_paper = Counter(paper_key(e) for e in entries)
    for key in PAPER_NAMES:
        group = [e for e in entries if paper_key(e) == key]
        if not group:
            continue
        proved = sum(e["proof"] == "proved" for e in group)
        lines.append(f"| {PAPER_NAMES[key]} | {by_paper[key]} | {proved} | {len(group) - proved} | "
                     f"{sum(bool(e['tests']) for e in group)} | {sum(bool(e['cells']) for e in group)} |")
    total_proved = sum(e["proof"] == "proved" for e in entries)
    lines += [f"| **all** | **{len(entries)}** | **{total_proved}** | **{len(entries) - total_proved}** | "
              f"**{sum(bool(e['tests']) for e in entries)}** | **{sum(bool(e['cells']) for e in entries)}** |", ""]
    cited = [e for e in entries if e["proof"] != "proved"]
    if cited:
        lines += ["## Cited rather than proved", "",
                  "These results are used with a reference instead of a proof, for the reason given:", ""]
        lines += [f"* {{ref}}`{e['result']} <{e['statement']}>`: {_proof(e)}" for e in cited]
        lines.append("")
    for chapter in sorted({chapter_of(e) for e in entries}):
        group = [e for e in entries if chapter_of(e) == chapter]
        lines += [f"## Chapter {chapter}" if chapter else "## Elsewhere", ""]
        for e in group:
            paper = "the book's own" if paper_key(e) == "book" else f"{{cite:t}}`{paper_key(e)}`" + \
                (f" {_cell(' '.join(str(e['paper']).split()[1:]))}" if len(str(e["paper"]).split()) > 1 else "")
            code = ", ".join(f"`{c}`" for c in e["code"])
            tests = ", ".join(f"`{t.replace('tests/', '')}`" for t in e["tests"])
            cells = ", ".join(f"{{ref}}`{c}`" for c in e["cells"])
            how = "proved" if e["proof"] == "proved" else "cited"
            lines += [f"* **{{ref}}`{_cell(e['result'])} <{e['statement']}>`** ({paper}; {how}).",
                      f"  Code: {code}. Tests: {tests}. Notebook: {cells}.", ""]
    return "\n".join(lines)


def figure(entries: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k in PAPER_NAMES if any(paper_key(e) == k for e in entries)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    kinds = [("proved", lambda e: e["proof"] == "proved"), ("cited", lambda e: e["proof"] != "proved"),
             ("test", lambda e: bool(e["tests"])), ("notebook check", lambda e: bool(e["cells"]))]
    width = 0.2
    for i, (name, has) in enumerate(kinds):
        counts = [sum(has(e) for e in entries if paper_key(e) == k) for k in keys]
        ax.bar([x + (i - 1.5) * width for x in range(len(keys))], counts, width, label=name)
    ax.set_xticks(range(len(keys)), [PAPER_NAMES[k].split(",")[0] for k in keys], fontsize=8)
    ax.set_ylabel("results")
    ax.set_title("Coverage: every result proved or cited, tested, and checked in a notebook")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    entries = load()
    print(render(entries))
    if "--figure" in sys.argv:
        figure(entries, ROOT / "book" / "_static" / "coverage.png")
