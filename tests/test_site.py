"""The course's static site (``make site``), checked as built and in a browser: ``make test-site``.

The site is read from build/site/_build/html (``make test-site`` builds it first). The file checks:
every chapter, the appendix, the glossary and the landing page are there; no line of any solution
region or hidden test is anywhere on it; the claim checks' code is hidden while the sentences they
render show; every figure and table of the notebooks is on its page; every chapter links to Binder.

The browser checks serve the folder on 127.0.0.1 (a free port, Python's http.server in a thread) and
open every page in the system's Chromium through Playwright: no console error, no failed request,
every image decoded, every link into the site and every #anchor resolving, every chapter reachable
from the landing page through the navigation, and no horizontal scroll at a phone's width (375 px).
Screenshots of the landing page and a chapter, at desktop and phone width, go to
bench-results/site/.

Marked ``site``: a run selects these tests only with ``-m site`` (tests/conftest.py), so ``make
test`` leaves them to ``make test-site``.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest

from ar_lab.course.grading.exercises import nbgrader_meta, student_version

pytestmark = pytest.mark.site

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SHOTS = Path(os.environ.get("AR_LAB_SCREENSHOTS", ROOT / "bench-results" / "site"))
PHONE = {"width": 375, "height": 812}
DESKTOP = {"width": 1280, "height": 900}
SOLUTION = re.compile(r"### BEGIN SOLUTION[^\n]*\n(.*?)^[ \t]*### END SOLUTION", re.M | re.S)
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS[^\n]*\n(.*?)^[ \t]*### END HIDDEN TESTS", re.M | re.S)
# Lines too common to give an answer away: a bare return of a name, pass, a lone bracket, else/try.
TRIVIAL = re.compile(r"^(return( \w+)?|pass|else:|try:|[)\]}]+,?|\w+|# .{0,20})$")


def load_build():
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build()
HTML = build.HTML


def page_file(notebook: Path) -> Path:
    return HTML / f"{notebook.stem}.html"


def text_of(markup: str) -> str:
    """What a reader can read on a page: tags dropped, entities decoded, whitespace collapsed."""
    markup = re.sub(r"<(script|style)\b.*?</\1>", " ", markup, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


def answer_lines(nb) -> list[str]:
    """Every non-trivial line of the notebook's solution regions and hidden tests (a solution cell
    without markers is all answer, as nbgrader reads it)."""
    lines = []
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            regions = (
                SOLUTION.findall(cell.source)
                if "### BEGIN SOLUTION" in cell.source
                else [cell.source]
            )
        else:
            regions = []
        if meta.get("grade") and cell.cell_type == "code":
            regions += HIDDEN.findall(cell.source)
        for region in regions:
            lines += [normal(line) for line in region.splitlines()]
    return [line for line in lines if line and not TRIVIAL.match(line)]


def normal(text: str) -> str:
    return " ".join(text.split())


def leaked(lines: list[str], code_lines: set[str], text: str) -> list[str]:
    """The answer lines a page shows: as a whole line of code or output, or (long enough to be
    unmistakable, 30 characters) anywhere in its text."""
    return [line for line in lines if line in code_lines or (len(line) >= 30 and line in text)]


def learner_text() -> str:
    """Everything the learner's versions show anyway: a line a solution shares with the chapter's
    own code or its instructions (`with torch.no_grad():`, the call an exercise asks for) gives
    nothing away."""
    return " \n ".join(normal(cell.source) for path in NOTEBOOKS
                       for cell in student_version(nbformat.read(path, as_version=4)).cells)


def code_lines_of(markup: str) -> set[str]:
    """Every line of every <pre> block (code and outputs) of a page, normalized."""
    lines = set()
    for block in re.findall(r"<pre\b[^>]*>(.*?)</pre>", markup, flags=re.S):
        lines |= {
            normal(line) for line in html.unescape(re.sub(r"<[^>]+>", "", block)).splitlines()
        }
    return lines


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    """Every built page's HTML, by file name."""
    if not (HTML / "index.html").is_file():
        pytest.fail(f"no site in {HTML}: run `make site` first (make test-site does)")
    return {p.name: p.read_text() for p in sorted(HTML.glob("*.html"))}


def test_every_chapter_the_appendix_glossary_and_landing_page_are_built(pages):
    expected = {"index.html", "glossary.html"} | {page_file(nb).name for nb in NOTEBOOKS}
    assert set(pages) == expected
    assert any(nb.name.startswith("A1_") for nb in NOTEBOOKS) and any(
        "b_" in nb.name[:4] for nb in NOTEBOOKS
    )
    for nb in NOTEBOOKS:
        title = nbformat.read(nb, as_version=4).cells[0].source.splitlines()[0].lstrip("# ").strip()
        assert f"<h1>{html.escape(title)}</h1>" in pages[page_file(nb).name], nb.name


def test_the_leak_check_finds_a_planted_solution():
    """The check below is not vacuous: every chapter with exercises has answer lines, and a page
    holding the source notebook's text (solutions included) is caught."""
    with_exercises = 0
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        lines = answer_lines(nb)
        if any(nbgrader_meta(c).get("solution") for c in nb.cells):
            with_exercises += 1
            assert lines, path.name
            source_lines = {normal(line) for c in nb.cells for line in c.source.splitlines()}
            assert leaked(lines, source_lines, "") == lines, path.name
    assert with_exercises >= 10


def test_no_solution_region_or_hidden_test_anywhere_on_the_site(pages):
    everything = " ".join(text_of(markup) for markup in pages.values())
    everything += " " + " ".join(normal(html.unescape(m)) for m in pages.values())  # attributes too
    code_lines = set().union(*(code_lines_of(markup) for markup in pages.values()))
    found, shown, checked = {}, learner_text(), 0
    for path in NOTEBOOKS:
        lines = [
            line for line in answer_lines(nbformat.read(path, as_version=4)) if line not in shown
        ]
        checked += len(lines)
        hits = leaked(lines, code_lines, everything)
        if hits:
            found[path.name] = hits[:5]
    assert not found, f"solution lines on the site: {found}"
    assert checked > 200  # the answers' own lines, every chapter's
    assert "raise NotImplementedError()" in everything  # the learner's stubs are what shows


def rendered_sentences(cell) -> list[str]:
    """The text of the Markdown a collapsed cell displayed (what the site must show)."""
    import mistune

    out = []
    for output in cell.get("outputs", []):
        source = output.get("data", {}).get("text/markdown")
        if source:
            out.append(text_of(mistune.html("".join(source))))
    return out


def test_claim_checks_are_hidden_and_their_sentences_shown(pages):
    hidden_cells = 0
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        text = text_of(pages[page_file(path).name])
        code = set().union(*(code_lines_of(block) for block in re.findall(
            r'<pre class="code">.*?</pre>', pages[page_file(path).name], flags=re.S)))
        visible = {
            normal(line)
            for c in nb.cells
            if c.cell_type == "code" and not c.metadata.get("jupyter", {}).get("source_hidden")
            for line in c.source.splitlines()
        }
        for cell in nb.cells:
            if cell.cell_type != "code" or not cell.metadata.get("jupyter", {}).get(
                "source_hidden"
            ):
                continue
            hidden_cells += 1
            assert "remove-input" in cell.metadata.get("tags", []), (path.name, cell.source[:60])
            lines = {normal(line) for line in cell.source.splitlines()} - visible - {""}
            shown = sorted(lines & code)
            assert not shown, f"{path.name}: a collapsed cell's code is on the page: {shown[:3]}"
            for sentence in rendered_sentences(cell):
                assert sentence in text, (
                    f"{path.name}: a rendered sentence is missing: {sentence[:80]}"
                )
    assert hidden_cells >= 20


def test_every_formula_is_drawn_as_mathml(pages):
    """Each $...$ and $$...$$ of a chapter's prose is a MathML <math> element on its page (browsers
    draw it without scripts), not TeX source."""
    for path in NOTEBOOKS:
        prose = "\n".join(
            c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"
        )
        displays = len(re.findall(r"\$\$.+?\$\$", prose, re.S))
        inline = len(
            re.findall(
                r"(?<![$\\])\$[^$\n]+?\$(?!\$)", re.sub(r"\$\$.+?\$\$", "", prose, flags=re.S)
            )
        )
        page = pages[page_file(path).name]
        assert page.count("<math") >= displays + inline, (
            f"{path.name}: {displays} + {inline} formulas in the prose"
        )
        assert 'class="math tex"' not in page, f"{path.name}: a formula left as TeX source"
    assert sum(p.count("<math") for p in pages.values()) >= 3


def markdown_tables(nb) -> int:
    """Markdown tables in the notebook's prose and in the Markdown its cells displayed (a delimiter
    row each)."""
    texts = [c.source for c in nb.cells if c.cell_type == "markdown"]
    texts += ["".join(o["data"]["text/markdown"]) for c in nb.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})]
    return sum(len(re.findall(r"^\s*\|?\s*:?-{3,}:?\s*\|", text, re.M)) for text in texts)


def test_every_figure_and_table_of_the_notebooks_is_on_its_page(pages):
    tables = 0
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        tables += markdown_tables(nb)
        assert pages[page_file(path).name].count("<table") == markdown_tables(nb), path.name
        figures = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
        sources = re.findall(
            r'<figure class="output"><img src="([^"]+)"', pages[page_file(path).name]
        )
        assert len(sources) == figures, path.name
        for src in sources:
            assert (HTML / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
    assert tables >= 3


def test_the_landing_page_is_the_readme_course_map(pages):
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([0-9A-Za-z_]+)` \| (.+?) \|", readme, re.M)
    named = {name for name, _ in rows}
    assert {nb.stem for nb in NOTEBOOKS} <= named  # the map names every notebook
    landing = pages["index.html"]
    for nb in NOTEBOOKS:
        assert f'href="{page_file(nb).name}"><code>{nb.stem}</code></a>' in landing, nb.stem
    # MyST's typography
    quotes = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"'})
    landing_text = text_of(landing).translate(quotes)
    for _, learn in rows:  # each row's "what you learn", as the README says it
        words = re.sub(r"[*`]", "", learn).split()
        assert " ".join(words[:8]) in landing_text and " ".join(words[-4:]) in landing_text, learn[
            :60
        ]
    assert 'href="glossary.html"' in landing


def test_every_chapter_opens_on_binder(pages):
    postbuild = (ROOT / "binder" / "postBuild").read_text()
    assert "release --out course" in postbuild  # Binder's course/ holds the student versions
    for nb in NOTEBOOKS:
        links = re.findall(r'href="(https://mybinder\.org/v2/gh/[^"]+)"', pages[page_file(nb).name])
        assert len(links) == 1, nb.name
        url = urllib.parse.urlparse(html.unescape(links[0]))
        assert re.fullmatch(r"/v2/gh/[\w.-]+/[\w.-]+/[\w./-]+", url.path), links[0]
        assert urllib.parse.parse_qs(url.query)["urlpath"] == [f"lab/tree/course/{nb.name}"]


@pytest.mark.parametrize("remote, url", [
    ("https://github.com/someone/ar_lab.git", "https://github.com/someone/ar_lab"),
    ("git@github.com:someone/ar_lab.git", "https://github.com/someone/ar_lab"),
    ("https://github.com/someone/ar_lab", "https://github.com/someone/ar_lab"),
    ("https://gitlab.com/someone/ar_lab.git", None),
    ("/work/main", None),
])
def test_the_binder_links_follow_the_clones_github_remote(remote, url):
    assert build.github_url(remote) == url


def test_make_site_says_what_to_install_without_node(tmp_path):
    """With no node on PATH the build stops at once, with one line naming what to install."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "site" / "build.py")],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(tmp_path)},
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode != 0
    line = run.stderr.strip()
    assert "\n" not in line and "Node.js" in line and "apt-get install nodejs npm" in line, (
        run.stderr
    )


def test_the_site_notebook_keeps_outputs_but_not_answers_or_their_passing():
    """site_notebook: the student version's cells, the committed outputs of every cell that is
    neither an answer nor a graded test (a stub is never followed by its solution's ✔), without the
    lines that say a cell ran on the learner's piece."""
    path = next(p for p in NOTEBOOKS if p.name.startswith("04_"))
    nb = nbformat.read(path, as_version=4)
    page = build.site_notebook(nb)
    assert len(page.cells) == len(nb.cells)
    said = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "▶ this runs on your" in said  # what the page must drop is in the source's outputs
    kept = 0
    for source, cell in zip(nb.cells, page.cells, strict=True):
        if cell.cell_type != "code":
            continue
        meta = nbgrader_meta(source)
        if meta.get("solution"):
            assert cell.outputs == [] and "raise NotImplementedError()" in cell.source
        elif meta.get("grade"):
            assert cell.outputs == [] and "### BEGIN HIDDEN TESTS" not in cell.source
        else:
            texts = [o.get("text", "") for o in cell.outputs]
            assert not any("▶ this runs on your" in t for t in texts)
            kept += cell.outputs == source.outputs
    assert kept > 10  # the other cells keep their outputs as committed


# --- in a browser ---------------------------------------------------------------------------------

class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def served(pages):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(HTML)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is missing: pip install -r requirements/dev.txt")
    from browser.jupyterlab import CHROMIUM_ARGS, find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.fail("no Chromium: apt-get install chromium (or set AR_LAB_CHROMIUM)")
    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


PAGE_FACTS = """() => ({
  title: document.querySelector('h1') ? document.querySelector('h1').textContent : null,
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  nav: [...document.querySelectorAll('nav.toc a, footer.steps a')].map(a => a.href),
  images: [...document.images].map(i => ({src: i.currentSrc || i.src,
                                          ok: i.complete && i.naturalWidth > 0})),
})"""


def visit(browser, url: str, viewport: dict) -> tuple[dict, list[str]]:
    """Open ``url``; its facts (PAGE_FACTS) and every console error, page error and failed
    request."""
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    problems: list[str] = []
    page.on(
        "console",
        lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on(
        "response",
        lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
    )
    try:
        page.goto(url, wait_until="load")
        page.wait_for_function("[...document.images].every(i => i.complete)")
        facts = page.evaluate(PAGE_FACTS)
        facts["overflow"] = page.evaluate(
            "() => ({page: document.scrollingElement.scrollWidth - window.innerWidth, main: "
            "document.querySelector('main').scrollWidth - "
            "document.querySelector('main').clientWidth})"
        )
        facts["plots"] = page.evaluate(  # each figure's image: [its width on the page, its own]
            "() => [...document.querySelectorAll('figure.output img')].map(i => [i.width, "
            "i.naturalWidth])"
        )
        return facts, problems
    finally:
        context.close()


@pytest.fixture(scope="module")
def crawl(browser, served, pages):
    """Every page at desktop width: its facts and problems, by file name."""
    return {name: visit(browser, served + name, DESKTOP) for name in pages}


def test_every_page_loads_without_console_errors_and_every_image_loads(crawl):
    for name, (facts, problems) in crawl.items():
        assert not problems, f"{name}: {problems[:5]}"
        broken = [i["src"] for i in facts["images"] if not i["ok"]]
        assert not broken, f"{name}: images that did not load: {broken}"
    assert sum(len(facts["images"]) for facts, _ in crawl.values()) >= 20


def test_navigation_reaches_every_chapter_from_the_landing_page(crawl, served):
    reached, todo = set(), ["index.html"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for href in crawl[name][0]["nav"]:
            assert href.startswith(served), href
            todo.append(urllib.parse.urlparse(href).path.lstrip("/") or "index.html")
    assert reached == set(crawl)


def test_internal_links_and_anchors_resolve(crawl, served):
    ids = {name: set(facts["ids"]) for name, (facts, _) in crawl.items()}
    checked = anchors = 0
    for name, (facts, _) in crawl.items():
        for href in facts["links"]:
            if not href.startswith(served):
                assert urllib.parse.urlparse(href).scheme in ("http", "https"), f"{name}: {href}"
                continue
            parsed = urllib.parse.urlparse(href)
            target = parsed.path.lstrip("/") or "index.html"
            assert target in ids, f"{name} links to a missing page: {href}"
            checked += 1
            if parsed.fragment:
                anchors += 1
                anchor = urllib.parse.unquote(parsed.fragment)
                assert anchor in ids[target], f"{name}: no #{anchor} in {target}"
    assert checked > 100 and anchors > 50


def test_pages_are_readable_at_a_phones_width(browser, served, pages):
    for name in pages:
        facts, problems = visit(browser, served + name, PHONE)
        assert not problems, f"{name}: {problems[:5]}"
        assert facts["overflow"]["page"] <= 0, (
            f"{name} scrolls sideways by {facts['overflow']['page']} px at 375 px"
        )
        assert facts["overflow"]["main"] <= 0, (
            f"{name}: the text overflows by {facts['overflow']['main']} px"
        )
        # a plot is not shrunk below 34rem (544 px): its labels stay readable; it scrolls inside
        # its figure instead
        small = [(w, n) for w, n in facts["plots"] if w < min(n, 544) - 1]
        assert not small, f"{name}: plots shrunk to illegible widths (shown, own): {small[:3]}"


def test_screenshots_of_the_landing_page_and_a_chapter(browser, served):
    SHOTS.mkdir(parents=True, exist_ok=True)
    chapter = page_file(next(p for p in NOTEBOOKS if p.name.startswith("04_"))).name
    for name in ("index.html", chapter):
        for label, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
            context = browser.new_context(viewport=viewport)
            page = context.new_page()
            page.goto(served + name, wait_until="load")
            if name == chapter:  # the first figure, with the text around it
                page.locator("figure.output").first.scroll_into_view_if_needed()
            shot = SHOTS / f"{Path(name).stem}-{label}.png"
            page.screenshot(path=str(shot))
            context.close()
            assert shot.stat().st_size > 10_000
