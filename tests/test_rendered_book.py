"""The rendered book, checked in headless Chromium (after `make book`; run by `make check-book`).

Every page of the table of contents loads, its math is typeset by MathJax (no raw TeX left),
its images are non-empty, and every internal link resolves to an existing page and anchor. A
screenshot of chapter 1 is saved to _build/screenshots/chapter1.png (CI keeps it as an artifact).
Skipped when the book is not built or Chromium is absent, unless MINIMOE_REQUIRE_BOOK=1.
"""
import base64
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("MINIMOE_REQUIRE_BOOK") == "1"

if not (HTML / "index.html").exists() or CHROMIUM is None:
    reason = "book not built (make book)" if CHROMIUM else "chromium not installed"
    if REQUIRED:
        raise RuntimeError(f"MINIMOE_REQUIRE_BOOK=1 but {reason}")
    pytest.skip(reason, allow_module_level=True)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--virtual-time-budget=8000"]


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


def chromium(*args):
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=120)


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


@pytest.fixture(scope="module")
def rendered():
    pages = {}
    for source in toc_pages():
        path = HTML / f"{source}.html"
        assert path.exists(), f"{source} is in the TOC but {path} was not built"
        result = chromium("--dump-dom", path.as_uri())
        assert result.returncode == 0 and "</html>" in result.stdout, f"{source} did not load: {result.stderr[-500:]}"
        pages[source] = (path, result.stdout)
    return pages


def test_every_page_loads_with_content(rendered):
    for source, (path, dom) in rendered.items():
        page = parse(dom)
        assert len("".join(page.text).split()) > 50, f"{source} looks empty"


def test_math_is_typeset_offline(rendered):
    sources_with_math = 0
    for source, (path, dom) in rendered.items():
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
    for source, (path, dom) in rendered.items():
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


def test_internal_links_resolve(rendered):
    cache = {}
    for source, (path, dom) in rendered.items():
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


def test_screenshot_of_chapter_1():
    out = ROOT / "_build" / "screenshots" / "chapter1.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = chromium(f"--screenshot={out}", "--window-size=1280,2000",
                      (HTML / "book" / "01-moe-layer.html").as_uri())
    assert result.returncode == 0 and out.exists() and out.stat().st_size > 20_000, result.stderr[-500:]
