"""Run-once bookkeeping for the notebooks, shared by ``make test`` and ``make book``.

``stage.py notebooks``  copies notebooks/*.ipynb to _executed/ (where ``make test`` runs them
                        under ``pytest --nbmake --overwrite``, leaving the executed copies there) and
                        records a fingerprint of each notebook and of the minimoe package.
``stage.py book``       (the student edition: exercises without their solutions) lays out the book's sources in _build/src/: chapters (and the coverage appendix,
                        generated from book/coverage.yml; the chapters' figures, drawn by
                        figures.py), _config.yml, _toc.yml,
                        references.bib, the vendored MathJax, and for each notebook the executed copy
                        when its fingerprint is still current (so the book build does not run it
                        again: it is also listed in execute.exclude_patterns), else the clean
                        notebook (which Jupyter Book then executes).
``stage.py book-instructor``  the same, with the worked solutions of book/solutions/ as a last part of
                        the table of contents (``make book-instructor``).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "_build"
EXECUTED = ROOT / "_executed"  # not under _build: nbmake skips any path containing "_build"
SRC = BUILD / "src"
MATHJAX_CACHE = ROOT / ".cache" / "mathjax"
MATHJAX_CDN = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"


def fingerprint(notebook: Path) -> str:
    h = hashlib.sha256(notebook.read_bytes())
    for path in sorted((ROOT / "minimoe").rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def stage_notebooks() -> None:
    shutil.rmtree(EXECUTED, ignore_errors=True)
    EXECUTED.mkdir(parents=True)
    prints = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        shutil.copy2(nb, EXECUTED / nb.name)
        prints[nb.name] = fingerprint(nb)
    (EXECUTED / "fingerprints.json").write_text(json.dumps(prints, indent=1))
    print(f"staged {len(prints)} notebooks in {EXECUTED.relative_to(ROOT)}")


def has_outputs(nb: Path) -> bool:
    cells = json.loads(nb.read_text())["cells"]
    return any(c.get("outputs") for c in cells if c["cell_type"] == "code")


def vendor_mathjax() -> bool:
    """MathJax 3 (es5 build) from the npm registry, cached in .cache/mathjax. False if unavailable."""
    if (MATHJAX_CACHE / "tex-chtml.js").exists():
        return True
    if shutil.which("npm") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["npm", "pack", "mathjax@3", "--silent"], cwd=tmp, check=True,
                           capture_output=True, timeout=300)
        except (subprocess.SubprocessError, OSError):
            return False
        tarball = next(Path(tmp).glob("mathjax-*.tgz"))
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        MATHJAX_CACHE.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(MATHJAX_CACHE, ignore_errors=True)
        shutil.copytree(Path(tmp) / "package" / "es5", MATHJAX_CACHE)
    return True


def book_ignore(instructor: bool):
    """What of book/ is not staged: the scripts, and the solutions unless this is the instructor edition."""
    return shutil.ignore_patterns("_scripts", "__pycache__", *(() if instructor else ("solutions",)))


def toc_with_solutions(toc: str, solution_pages: list[str]) -> str:
    """The table of contents with a last part listing the solution pages (``book/solutions/NAME``)."""
    entries = "".join(f"      - file: book/solutions/{name}\n" for name in solution_pages)
    return toc.rstrip("\n") + "\n  - caption: Solutions (instructor edition)\n    chapters:\n" + entries


def stage_book(instructor: bool = False) -> None:
    shutil.rmtree(SRC, ignore_errors=True)
    SRC.mkdir(parents=True)
    for name in ("_toc.yml", "references.bib"):
        shutil.copy2(ROOT / name, SRC / name)
    shutil.copytree(ROOT / "book", SRC / "book", ignore=book_ignore(instructor))
    if instructor:
        pages = sorted(p.stem for p in (ROOT / "book" / "solutions").glob("*.md"))
        (SRC / "_toc.yml").write_text(toc_with_solutions((ROOT / "_toc.yml").read_text(), pages))
    # the appendix "What is proved, where it runs" is generated from book/coverage.yml
    sys.path.insert(0, str(ROOT / "book" / "_scripts"))
    import coverage_page
    (SRC / "book" / "coverage.md").write_text(coverage_page.render(coverage_page.load()))
    # each chapter's figure is drawn from today's code (book/_scripts/figures.py), never committed
    import figures
    figures.draw(SRC / "book" / "figures")
    # the appendix "Performance" includes the committed benchmark tables (literalinclude)
    shutil.copytree(ROOT / "benchmarks" / "results", SRC / "benchmarks" / "results",
                    ignore=shutil.ignore_patterns("*.json", "*-quick.*"))
    (SRC / "notebooks").mkdir()
    prints_file = EXECUTED / "fingerprints.json"
    prints = json.loads(prints_file.read_text()) if prints_file.exists() else {}
    reused = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        executed = EXECUTED / nb.name
        if prints.get(nb.name) == fingerprint(nb) and executed.exists() and has_outputs(executed):
            shutil.copy2(executed, SRC / "notebooks" / nb.name)
            reused.append(nb.name)
        else:
            shutil.copy2(nb, SRC / "notebooks" / nb.name)
    config = (ROOT / "_config.yml").read_text()
    if vendor_mathjax():
        shutil.copytree(MATHJAX_CACHE, SRC / "_mathjax" / "mathjax")
    else:
        print("MathJax could not be vendored (no npm or no registry): the book will load it from a CDN")
        (SRC / "_mathjax").mkdir()
        config = config.replace("mathjax_path: mathjax/tex-chtml.js", f"mathjax_path: {MATHJAX_CDN}")
    # execute_notebooks: auto would run a notebook again if any code cell has no output (an import
    # cell, say), so the executed copies are excluded from execution by name
    if reused:
        patterns = ", ".join(f'"notebooks/{name}"' for name in reused)
        config = config.replace("  exclude_patterns: []", f"  exclude_patterns: [{patterns}]", 1)
    (SRC / "_config.yml").write_text(config)
    print(f"staged the book in {SRC.relative_to(ROOT)}; reusing executed notebooks: {reused or 'none'}")


if __name__ == "__main__":
    commands = {"notebooks": stage_notebooks, "book": stage_book,
                "book-instructor": lambda: stage_book(instructor=True)}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(commands)}}}")
    commands[sys.argv[1]]()
