"""The book's pointers into the code are real.

Two sources of pointers are checked against the repository, without building the book:

* every chapter's "In code" table: each `tests/...::name` names an existing test function, each
  {py:func}/{py:class}/{py:mod} target imports, and each {ref} label is defined in a chapter or a
  notebook;
* the coverage list `book/coverage.yml` (rendered as the appendix "What is proved, where it runs"):
  each result names its statement's label, a proof that follows it (or a citation with a reason),
  the functions that implement it, the tests that check it, and notebook cells whose section
  asserts something (a cell that only prints checks nothing).
"""
from __future__ import annotations

import ast
import importlib
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(BOOK.glob("[0-9]*.md"))
# MINIMOE_COVERAGE points the checks at another file (a draft of one chapter's entries).
COVERAGE = Path(os.environ.get("MINIMOE_COVERAGE", BOOK / "coverage.yml"))

# A MyST target: `(label)=` on its own line (in a notebook, inside a markdown cell: `# (label)=`), or
# the `:name: label` option of a directive.
LABEL = re.compile(r"^\s*(?:#\s*)?(?:\(([A-Za-z0-9_.:-]+)\)=|:name:\s*([A-Za-z0-9_.:-]+))\s*$", re.M)
TEST_POINTER = re.compile(r"`(tests/[\w/]+\.py)::([\w:]+)(?:\[[^\]]*\])?`")
PY_ROLE = re.compile(r"\{py:(?:func|class|mod|meth|attr|data)\}`(?:[^`<]*<)?~?([\w.]+)>?`")
REF_ROLE = re.compile(r"\{ref\}`(?:[^`<]*<)?([A-Za-z0-9_.:-]+)>?`")


@lru_cache(maxsize=None)
def labels() -> dict[str, Path]:
    """Every MyST target `(label)=` in the chapters and in the notebooks' markdown cells."""
    found = {}
    for path in [*BOOK.glob("*.md"), *NOTEBOOKS.glob("*.py")]:
        for match in LABEL.finditer(path.read_text()):
            found[match.group(1) or match.group(2)] = path
    return found


@lru_cache(maxsize=None)
def functions_of_test_file(path: str) -> frozenset[str]:
    """`name` and `Class::name` of every test function in a test file."""
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return frozenset(names)


def pointer_problem(path: str, name: str) -> str | None:
    if not (ROOT / path).exists():
        return f"{path} does not exist"
    if name not in functions_of_test_file(path):
        return f"{path} has no test {name}"
    return None


def import_problem(dotted: str) -> str | None:
    """None when `dotted` is an importable module or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{dotted}: {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return None
    return f"{dotted} does not import"


def in_code_tables(path: Path) -> list[str]:
    """The table rows of a chapter's "In code" section."""
    text = path.read_text()
    start = re.search(r"^## In code\s*$", text, re.M)
    if start is None:
        return []
    rest = text[start.end():]
    end = re.search(r"^#{1,2} ", rest, re.M)
    section = rest[: end.start()] if end else rest
    return [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]


def row_problems(row: str) -> list[str]:
    problems = []
    for path, name in TEST_POINTER.findall(row):
        if (problem := pointer_problem(path, name)) is not None:
            problems.append(problem)
    for dotted in PY_ROLE.findall(row):
        if (problem := import_problem(dotted)) is not None:
            problems.append(problem)
    for label in REF_ROLE.findall(row):
        if label not in labels():
            problems.append(f"label {label} is not defined")
    return problems


@pytest.mark.parametrize("chapter", [p for p in CHAPTERS if in_code_tables(p)], ids=lambda p: p.stem)
def test_in_code_tables_point_at_things_that_exist(chapter):
    problems = [f"{chapter.name}: {problem}" for row in in_code_tables(chapter) for problem in row_problems(row)]
    assert not problems, "\n".join(problems)


def test_every_chapter_with_results_has_an_in_code_table():
    for chapter in CHAPTERS[:8]:
        assert in_code_tables(chapter), f"{chapter.name} has no '## In code' table"


def test_the_checker_catches_a_dangling_pointer():
    row = ("| x | {py:func}`minimoe.ops.no_such_op` | `tests/test_sinkhorn.py::test_no_such_test` "
           "| {ref}`nb99-nowhere` |")
    problems = row_problems(row)
    assert len(problems) == 3, problems
    assert row_problems("| x | {py:func}`minimoe.ops.sinkhorn` | `tests/test_sinkhorn.py::test_marginals` "
                        "| {ref}`nb03-convergence` |") == []


# --- the coverage list -------------------------------------------------------------------------

def section_after(path: Path, label: str) -> str:
    """The text from `(label)=` to the next label of the same kind (or the next heading)."""
    text = path.read_text()
    match = re.search(rf"^\s*(?:#\s*)?(?:\({re.escape(label)}\)=|:name:\s*{re.escape(label)})\s*$", text, re.M)
    rest = text[match.end():]
    if path.suffix == ".py":  # a notebook: up to the next notebook label
        end = re.search(r"^# \((nb[\w-]+)\)=\s*$", rest, re.M)
    else:  # a chapter: up to the next label (equation labels aside)
        end = re.search(r"^\((?!eq-)[\w-]+\)=\s*$", rest, re.M)
    return rest[: end.start()] if end else rest


def cell_asserts(label: str) -> bool:
    code = [line for line in section_after(labels()[label], label).splitlines() if not line.startswith("#")]
    return any(re.search(r"\bassert\b|assert_close|assert_allclose|check_\w+\(", line) for line in code)


def coverage_entries() -> list[dict]:
    return yaml.safe_load(COVERAGE.read_text())["results"]


FIELDS = {"id", "result", "paper", "statement", "proof", "code", "tests", "cells"}


def entry_problems(entry: dict) -> list[str]:
    where = entry.get("id", "?")
    problems = [f"{where}: missing {field}" for field in sorted(FIELDS - set(entry)) if field != "paper"]
    problems += [f"{where}: unknown field {field}" for field in sorted(set(entry) - FIELDS - {"note"})]
    if "<" in str(entry.get("result", "")):
        problems.append(f"{where}: '<' in result breaks the {{ref}} of the appendix; write it in words")
    statement = entry.get("statement")
    if statement is not None and statement not in labels():
        problems.append(f"{where}: statement label {statement} is not defined")
    proof = entry.get("proof")
    if proof == "proved":
        if statement in labels() and not re.search(r":::\{admonition\} Proof|\*Proof\.\*", section_after(labels()[statement], statement)):
            problems.append(f"{where}: 'proved' but no Proof block follows {statement}")
    elif isinstance(proof, dict) and set(proof) == {"cited", "why"}:
        bib = (ROOT / "references.bib").read_text()
        for key in re.split(r"[,\s]+", proof["cited"].strip()):
            if not re.search(rf"@\w+\{{{re.escape(key)},", bib):
                problems.append(f"{where}: cited key {key} is not in references.bib")
    elif proof is not None:
        problems.append(f"{where}: proof must be 'proved' or {{cited: <bib keys>, why: <reason>}}")
    for dotted in entry.get("code") or []:
        if (problem := import_problem(dotted)) is not None:
            problems.append(f"{where}: {problem}")
    for pointer in entry.get("tests") or []:
        path, _, name = pointer.partition("::")
        if (problem := pointer_problem(path, name)) is not None:
            problems.append(f"{where}: {problem}")
    for label in entry.get("cells") or []:
        if label not in labels() or labels()[label].suffix != ".py":
            problems.append(f"{where}: notebook label {label} is not defined")
        elif not cell_asserts(label):
            problems.append(f"{where}: the section of {label} asserts nothing")
    for field in ("code", "tests", "cells"):
        if field in entry and not entry[field]:
            problems.append(f"{where}: empty {field}")
    return problems


def test_coverage_list_points_at_things_that_exist():
    entries = coverage_entries()
    ids = [e.get("id") for e in entries]
    assert len(ids) == len(set(ids)), "duplicate ids in book/coverage.yml"
    problems = [p for entry in entries for p in entry_problems(entry)]
    assert not problems, "\n".join(problems)


RESULT = re.compile(r"^:::\{admonition\} (Proposition|Lemma|Theorem|Corollary|Algorithm) (\d+\.\d+)", re.M)


def test_every_numbered_result_of_the_book_is_in_the_coverage_list():
    listed = {" ".join(e["result"].split()[:2]) for e in coverage_entries()}
    missing = [f"{chapter.name}: {kind} {number}" for chapter in CHAPTERS
               for kind, number in RESULT.findall(chapter.read_text()) if f"{kind} {number}" not in listed]
    assert not missing, "results not in book/coverage.yml:\n" + "\n".join(missing)


def test_the_coverage_checker_catches_a_bad_entry():
    bad = {"id": "x", "result": "x", "statement": "ch99-nothing", "proof": "maybe",
           "code": ["minimoe.ops.nothing"], "tests": ["tests/test_sinkhorn.py::test_nothing"], "cells": ["nb99-x"]}
    assert len(entry_problems(bad)) == 5, entry_problems(bad)


def test_the_book_map_names_real_notebooks_and_modules():
    import importlib.util
    spec = importlib.util.spec_from_file_location("book_map", BOOK / "_scripts" / "book_map.py")
    book_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(book_map)
    for chapter, (title, papers, notebooks, modules) in book_map.CHAPTERS.items():
        assert len(list(BOOK.glob(f"{chapter:02d}-*.md"))) == 1, f"chapter {chapter}"
        assert set(papers) <= set(book_map.PAPERS)
        for number in notebooks:
            assert len(list(NOTEBOOKS.glob(f"{number}-*.py"))) == 1, f"notebook {number}"
        for module in modules:
            assert import_problem(module) is None, module
