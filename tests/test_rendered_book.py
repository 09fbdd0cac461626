"""The rendered book, checked in headless Chromium as a reader sees it (after `make book`; run by
`make check-book`).

Every page of the table of contents loads, its math is typeset by MathJax (no raw TeX left), its
images are non-empty, every internal link resolves to an existing page and anchor, and no page is
absurdly long. Every notebook page shows what a reader wants to read: a few output blocks per
cell, nothing written to stderr (no progress-bar fragments), no warning, no traceback. A full-page
screenshot of every page is saved to _build/screenshots/<page>.png (CI keeps them as artifacts).
Chromium is driven over the DevTools protocol on a pipe (tests/cdp.py).
Runs only under MINIMOE_REQUIRE_BOOK=1 (make check-book), and then fails if the book or Chromium is missing.
"""
import base64
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml

from cdp import Browser

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("MINIMOE_REQUIRE_BOOK") == "1"

if not REQUIRED:
    # a build left over from earlier sources would be checked against today's table of contents
    pytest.skip("the rendered book is checked by make check-book (MINIMOE_REQUIRE_BOOK=1), after make book",
                allow_module_level=True)
if not (HTML / "index.html").exists() or CHROMIUM is None:
    raise RuntimeError("MINIMOE_REQUIRE_BOOK=1 but " + ("the book is not built (make book)" if CHROMIUM
                                                         else "chromium is not installed"))

SCREENSHOTS = ROOT / "_build" / "screenshots"
MAX_PAGE_HEIGHT = 60_000   # pixels at 1280 wide; the longest chapter is about half of that
# the API reference is every public docstring of the package on one page, so it grows with the package
MAX_API_PAGE_HEIGHT = 90_000
MAX_OUTPUT_BLOCKS = 8      # per notebook cell: a few prints and figures, not a stream of fragments

def toc_pages():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))
    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    return files


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.images, self.ids, self.mjx, self.text = [], [], set(), 0, []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "mjx-container":
            self.mjx += 1
        if tag in ("script", "style", "mjx-container", "pre", "code", "textarea"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style", "mjx-container", "pre", "code", "textarea"):
            self._skip = max(0, self._skip - 1)

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


def parse(html):
    page = Page()
    page.feed(html)
    return page


# pages are loaded and photographed by this many Chromiums side by side: on 2 cores the check took
# 189 s with one, 126 s with two and 134 s with three (one per core, at most two)
BROWSERS = max(1, min(2, os.cpu_count() or 1))


LOADED_FIGURES: dict[str, str] = {}   # page -> JSON list of the figure images that loaded (filled by render)


def render(sources):
    """{page: (path, DOM after MathJax, page height in px)} for ``sources``, read by one Chromium; a
    full-page screenshot of each is saved."""
    browser = Browser(CHROMIUM)
    pages = {}
    try:
        for source in sources:
            path = HTML / f"{source}.html"
            assert path.exists(), f"{source} is in the TOC but {path} was not built"
            browser.open(path.as_uri())
            dom = browser.evaluate("document.documentElement.outerHTML")
            assert "</body>" in dom, f"{source} did not load"
            # the images the browser actually decoded, inside the page's figures
            LOADED_FIGURES[source] = browser.evaluate(
                "JSON.stringify(Array.from(document.querySelectorAll('figure img'))"
                ".filter(i => i.complete && i.naturalWidth > 0).map(i => i.getAttribute('src')))")
            height = browser.screenshot(SCREENSHOTS / f"{source.replace('/', '-')}.png")
            pages[source] = (path, dom, height)
    finally:
        browser.close()
    return pages


@pytest.fixture(scope="module")
def rendered():
    """Every page of the table of contents, rendered (:func:`render`), in its order. The pages are
    shared out among BROWSERS Chromiums: one on its own leaves a core idle much of the time (a page
    takes about 5 s, half of it loading and typesetting, half the screenshot)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    sources = toc_pages()
    with ThreadPoolExecutor(BROWSERS) as pool:
        parts = list(pool.map(render, [sources[i::BROWSERS] for i in range(BROWSERS)]))
    pages = {page: value for part in parts for page, value in part.items()}
    return {source: pages[source] for source in sources}


def test_every_page_loads_with_content(rendered):
    for source, (path, dom, _) in rendered.items():
        page = parse(dom)
        assert len("".join(page.text).split()) > 50, f"{source} looks empty"


def test_math_is_typeset_offline(rendered):
    sources_with_math = 0
    for source, (path, dom, _) in rendered.items():
        page = parse(dom)
        text = "".join(page.text)
        assert "$$" not in text and "\\begin{" not in text, f"{source} shows raw TeX"
        raw = ROOT / f"{source}.md"
        raw = raw if raw.exists() else ROOT / f"{source}.py"
        if raw.exists() and re.search(r"\$[^$\s]", raw.read_text()):
            sources_with_math += 1
            assert page.mjx > 0, f"{source} has math in its source but no <mjx-container> in the page"
    assert sources_with_math >= 2
    # The MathJax the pages load is the vendored copy, not a CDN.
    index = (HTML / "book" / "01-moe-layer.html").read_text()
    assert "_static/mathjax/tex-chtml.js" in index


def test_figures_are_non_empty_images(rendered):
    notebook_images = 0
    for source, (path, dom, _) in rendered.items():
        for src in parse(dom).images:
            if src.startswith("data:image"):
                payload = base64.b64decode(src.split(",", 1)[1])
            elif src.startswith("file:") or not urlparse(src).scheme:
                target = (path.parent / unquote(urlparse(src).path)).resolve()
                assert target.exists(), f"{source}: image {src} missing"
                payload = target.read_bytes()
            else:
                continue
            assert len(payload) > 1000, f"{source}: image {src[:80]} is (nearly) empty"
            if source.startswith("notebooks/"):
                notebook_images += 1
    assert notebook_images >= 5, "the executed notebooks should show their figures"


def test_every_chapter_shows_a_figure_that_loaded(rendered):
    import json
    chapters = [source for source in rendered if re.fullmatch(r"book/\d\d-[\w-]+", source)]
    assert len(chapters) >= 10
    for source in chapters:
        loaded = json.loads(LOADED_FIGURES[source])
        number = source.split("/")[1][:2]     # the chapter's figures are named chNN-*.png (book/_scripts/figures.py)
        assert any(re.search(rf"ch{number}-[\w-]+\.png$", src) for src in loaded), \
            f"{source}: no chapter figure loaded (got {loaded})"


def test_choosing_page_exists_and_the_intro_links_to_it(rendered):
    assert "book/choosing-a-router" in rendered
    intro = next(source for source in rendered if source.endswith("intro"))
    links = parse(rendered[intro][1]).links
    assert any("choosing-a-router.html" in href for href in links), "the intro does not link to the choosing page"


def test_internal_links_resolve(rendered):
    cache = {}
    for source, (path, dom, _) in rendered.items():
        for href in parse(dom).links:
            url = urlparse(href)
            if url.scheme in ("http", "https", "mailto", "javascript") or href.startswith("#") and len(href) == 1:
                continue
            target = path if not url.path else (path.parent / unquote(url.path)).resolve()
            if url.scheme == "file":
                target = Path(unquote(url.path))
            if target.is_dir():
                target = target / "index.html"
            assert target.exists(), f"{source}: broken link {href}"
            if url.fragment and target.suffix == ".html":
                if target not in cache:
                    cache[target] = parse(target.read_text()).ids
                assert url.fragment in cache[target], f"{source}: link {href} has no anchor #{url.fragment}"


def test_every_page_has_a_screenshot_and_a_sane_length(rendered):
    for source, (_, _, height) in rendered.items():
        shot = SCREENSHOTS / f"{source.replace('/', '-')}.png"
        assert shot.exists() and shot.stat().st_size > 20_000, f"{source}: no screenshot"
        limit = MAX_API_PAGE_HEIGHT if source == "book/api" else MAX_PAGE_HEIGHT
        assert 500 < height <= limit, f"{source} is {height} px tall (limit {limit})"


class CellOutputs(HTMLParser):
    """The cell-output containers of a notebook page: for each, its output blocks and text."""

    def __init__(self):
        super().__init__()
        self.cells, self._depth, self._inside = [], 0, None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div":
            self._depth += 1
            if "cell_output" in classes and self._inside is None:
                self._inside = self._depth
                self.cells.append({"blocks": 0, "stderr": False, "text": []})
                return
        if self._inside is not None:
            if tag == "div" and "output" in classes:
                self.cells[-1]["blocks"] += 1
                self.cells[-1]["stderr"] |= "stderr" in classes
            elif tag == "img":
                self.cells[-1]["blocks"] += 1

    def handle_endtag(self, tag):
        if tag == "div":
            if self._inside == self._depth:
                self._inside = None
            self._depth -= 1

    def handle_data(self, data):
        if self._inside is not None:
            self.cells[-1]["text"].append(data)


def output_problems(source: str, dom: str) -> list[str]:
    """What a reader should not see in a notebook page's cell outputs (numbered in page order)."""
    parser = CellOutputs()
    parser.feed(dom)
    problems = []
    for number, cell in enumerate(parser.cells, 1):
        text = "".join(cell["text"])
        if cell["blocks"] > MAX_OUTPUT_BLOCKS:
            problems.append(f"{source}, output {number}: {cell['blocks']} output blocks (limit {MAX_OUTPUT_BLOCKS})")
        if cell["stderr"]:
            problems.append(f"{source}, output {number}: writes to stderr: {text.strip()[:120]!r}")
        for word in ("Warning", "Traceback"):
            if word in text:
                at = text.index(word)
                problems.append(f"{source}, output {number}: shows {word!r}: {text[max(0, at - 60):at + 60]!r}")
    return problems


def test_notebook_pages_show_only_what_a_reader_wants(rendered):
    problems = [p for source, (_, dom, _) in rendered.items() if source.startswith("notebooks/")
                for p in output_problems(source, dom)]
    assert not problems, "\n".join(problems[:40])


def test_the_output_check_catches_progress_fragments_and_warnings():
    page = ('<div class="cell docutils container"><div class="cell_output docutils container">'
            + '<div class="output stderr highlight-myst-ansi notranslate">  3%|#</div>' * 20
            + '<div class="output stream">TqdmWarning: IProgress not found</div></div></div>'
            + '<p>A Warning in the prose is fine.</p>')
    problems = output_problems("demo", page)
    assert any("output blocks" in p for p in problems)
    assert any("stderr" in p for p in problems) and sum("Warning" in p for p in problems) == 1
    assert output_problems("demo", '<div class="cell docutils container"><div class="cell_output">'
                                   '<div class="output stream">loss 0.31</div><img src="x"></div></div>') == []
