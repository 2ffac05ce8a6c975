"""Render the course site's pages from MyST's page data (the theme's ``build.render`` step).

``jupyter-book build --html`` runs this with CONTENT_CDN (a local server holding config.json, each
page's AST under content/, and the figures) and BUILD_DIRECTORY (where the pages go). Every page is a
plain HTML file beside the others (index.html, <slug>.html) with relative links, one stylesheet and no
script, so the folder can be served from anywhere or opened from disk.

A code cell whose input MyST marks removed (the tag ``remove-input``) or whose input is collapsed
(``jupyter.source_hidden``) shows its output only: the course's claim checks stay out of the page while
the sentence they render stays in. Widgets cannot run on a static page: a note links to Binder instead.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import urllib.parse
import urllib.request
from pathlib import Path

import mistune

CDN = os.environ.get("CONTENT_CDN", "").rstrip("/")  # both set by jupyter-book (main says so when they are not)
OUT = Path(os.environ.get("BUILD_DIRECTORY", "."))
THEME = Path(__file__).resolve().parent
REPO = os.environ.get("AR_LAB_SITE_REPO", "")
BRANCH = os.environ.get("AR_LAB_BINDER_BRANCH", "main")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MARKDOWN = mistune.create_markdown(escape=False, plugins=["table", "strikethrough"])
WIDGET = "application/vnd.jupyter.widget-view+json"
NBVAL = re.compile(r"^[ \t]*# NBVAL_[A-Z_]+[ \t]*\n?", re.M)


def fetch(path: str) -> bytes:
    with urllib.request.urlopen(CDN + urllib.parse.quote(path)) as response:
        return response.read()


def esc(text: str) -> str:
    return html.escape(text, quote=True)


def binder_url(notebook: str) -> str:
    """Binder opens the student version (binder/postBuild writes it to course/) in JupyterLab."""
    parts = urllib.parse.urlparse(REPO).path.strip("/").split("/")
    owner, repo = (parts + ["", ""])[:2]
    return f"https://mybinder.org/v2/gh/{owner}/{repo}/{BRANCH}?urlpath=lab/tree/course/{notebook}"


_MATHML = re.compile(r"<math\b.*?</math>", re.S)


def math_html(node: dict, *, display: bool) -> str:
    """A formula as MathML, which browsers draw without scripts or fonts: the MathML half of the KaTeX rendering
    MyST stores in the node (``html``), without KaTeX's visual half (that needs KaTeX's CSS and fonts).
    Without a rendering, the TeX source, marked as such."""
    found = _MATHML.search(node.get("html", ""))
    if found:
        return f'<div class="math">{found.group(0)}</div>\n' if display else found.group(0)
    tex = html.escape(node.get("value", ""))
    return f'<div class="math tex">{tex}</div>\n' if display else f'<span class="math tex">{tex}</span>'


class Page:
    """One page's HTML from its MyST AST."""

    def __init__(self, slug: str, files: dict[str, str], index: str) -> None:
        self.slug, self.files, self.index = slug, files, index

    def href(self, url: str, anchor: str | None = None) -> str:
        """A site URL ("/slug", "/slug#id", "/" or a figure "/hash.png") as a relative link."""
        if not url.startswith("/") or url.startswith("//"):
            return url
        path, _, fragment = url.partition("#")
        fragment = anchor or fragment
        name = path.strip("/")
        if "." in name:  # a file MyST put beside the pages
            return self.asset(path)
        slug = name or self.index
        target = "" if slug == self.slug and fragment else self.files.get(slug, f"{slug}.html")
        return f"{target}#{fragment}" if fragment else target

    def asset(self, path: str) -> str:
        name = Path(path).name
        if not (OUT / name).exists():
            (OUT / name).write_bytes(fetch(path))
        return name

    def children(self, node: dict) -> str:
        return "".join(self.node(child) for child in node.get("children", []))

    def node(self, node: dict) -> str:  # noqa: C901 - one branch per MyST node type
        kind = node["type"]
        if node.get("visibility") == "remove" or kind in ("comment", "mystTarget", "footnoteDefinition"):
            return ""
        inner = self.children
        if kind == "text":
            return esc(node.get("value", ""))
        if kind == "paragraph":
            return f"<p>{inner(node)}</p>\n"
        if kind == "heading":
            depth = min(6, max(2, node.get("depth", 2)))
            ident = node.get("html_id") or node.get("identifier")
            attr = f' id="{esc(ident)}"' if ident else ""
            return f"<h{depth}{attr}>{inner(node)}</h{depth}>\n"
        if kind in ("emphasis", "strong", "delete", "subscript", "superscript"):
            tag = {"emphasis": "em", "strong": "strong", "delete": "del", "subscript": "sub", "superscript": "sup"}
            return f"<{tag[kind]}>{inner(node)}</{tag[kind]}>"
        if kind == "inlineCode":
            return f"<code>{esc(node.get('value', ''))}</code>"
        if kind == "link":
            return f'<a href="{esc(self.href(node.get("url", "")))}">{inner(node)}</a>'
        if kind == "crossReference":
            anchor = node.get("html_id") if node.get("kind") != "page" else None
            url = node.get("url") or f"/{self.slug}"
            return f'<a href="{esc(self.href(url, anchor))}">{inner(node)}</a>'
        if kind == "list":
            tag = "ol" if node.get("ordered") else "ul"
            start = f' start="{node["start"]}"' if node.get("ordered") and node.get("start", 1) != 1 else ""
            return f"<{tag}{start}>\n{inner(node)}</{tag}>\n"
        if kind == "listItem":
            return f"<li>{inner(node)}</li>\n"
        if kind == "code":
            lang = esc(node.get("lang") or "")
            code = NBVAL.sub("", node.get("value", ""))  # nbval's markers are for the tests, not the reader
            return f'<pre class="code"><code class="language-{lang}">{esc(code)}</code></pre>\n'
        if kind == "table":
            return self.table(node)
        if kind == "tableRow":
            return f"<tr>{inner(node)}</tr>\n"
        if kind == "tableCell":
            tag = "th" if node.get("header") else "td"
            align = f' style="text-align:{node["align"]}"' if node.get("align") else ""
            return f"<{tag}{align}>{inner(node)}</{tag}>"
        if kind == "thematicBreak":
            return "<hr>\n"
        if kind == "break":
            return "<br>"
        if kind == "blockquote":
            return f"<blockquote>{inner(node)}</blockquote>\n"
        if kind == "html":
            return node.get("value", "")
        if kind == "image":
            return f'<img src="{esc(self.href(node.get("url", "")))}" alt="{esc(node.get("alt", ""))}">'
        if kind in ("inlineMath", "math"):
            return math_html(node, display=kind == "math")
        if kind == "admonition":
            return f'<aside class="admonition">{inner(node)}</aside>\n'
        if kind == "admonitionTitle":
            return f'<p class="admonition-title">{inner(node)}</p>\n'
        if kind == "block":
            return self.block(node)
        if kind == "outputs":
            return "".join(self.output(child.get("jupyter_data", {})) for child in node.get("children", []))
        if kind == "output":
            return self.output(node.get("jupyter_data", {}))
        return inner(node)

    def table(self, node: dict) -> str:
        """A table; each body cell carries its column's header (data-label), which a phone shows beside the
        cell when the rows stack."""
        rows = [row for row in node.get("children", []) if row["type"] == "tableRow"]
        head = rows[0]["children"] if rows and all(c.get("header") for c in rows[0]["children"]) else []
        labels = [plain_text(cell) for cell in head]
        out = []
        for row in rows:
            cells = []
            for number, cell in enumerate(row["children"]):
                tag = "th" if cell.get("header") else "td"
                attr = f' style="text-align:{cell["align"]}"' if cell.get("align") else ""
                if tag == "td" and number < len(labels):
                    attr += f' data-label="{esc(labels[number])}"'
                cells.append(f"<{tag}{attr}>{self.children(cell)}</{tag}>")
            out.append(f'<tr{" class=head" if row["children"] is head else ""}>{"".join(cells)}</tr>\n')
        return f'<div class="table-wrap"><table>\n{"".join(out)}</table></div>\n'

    def block(self, node: dict) -> str:
        ident = node.get("html_id") or node.get("identifier")
        attr = f' id="{esc(ident)}"' if ident else ""
        if node.get("kind") != "notebook-code":
            return f"<section{attr}>\n{self.children(node)}</section>\n"
        hidden = (node.get("data") or {}).get("jupyter", {}).get("source_hidden")
        parts = []
        for child in node.get("children", []):
            if child["type"] == "code" and (hidden or child.get("visibility") in ("remove", "hide")):
                continue
            part = self.node(child)
            if child["type"] == "outputs" and part:
                part = f'<div class="outputs">\n{part}</div>\n'
            parts.append(part)
        body = "".join(parts)
        return f'<div class="cell"{attr}>\n{body}</div>\n' if body.strip() else ""

    def output(self, data: dict) -> str:
        kind = data.get("output_type")
        if kind == "stream":
            css = "stderr" if data.get("name") == "stderr" else "stream"
            return f'<pre class="output {css}">{esc(ANSI.sub("", data.get("text", "")))}</pre>\n'
        if kind == "error":
            text = ANSI.sub("", "\n".join(data.get("traceback", [])) or f"{data.get('ename')}: {data.get('evalue')}")
            return f'<pre class="output error">{esc(text)}</pre>\n'
        bundle = data.get("data", {})
        if WIDGET in bundle:
            return ('<p class="output widget">An interactive widget: open this chapter on Binder '
                    "(the link at the top of the page) to use it.</p>\n")
        if "image/png" in bundle or "image/jpeg" in bundle:
            item = bundle.get("image/png") or bundle["image/jpeg"]
            alt = self.content(bundle.get("text/plain", {})) or "figure"
            return f'<figure class="output"><img src="{esc(self.asset(item["path"]))}" alt="{esc(alt)}"></figure>\n'
        if "text/html" in bundle:
            return f'<div class="output html">{self.content(bundle["text/html"])}</div>\n'
        if "text/markdown" in bundle:
            return f'<div class="output markdown">{MARKDOWN(self.content(bundle["text/markdown"]))}</div>\n'
        if "text/plain" in bundle:
            return f'<pre class="output plain">{esc(ANSI.sub("", self.content(bundle["text/plain"])))}</pre>\n'
        return ""

    def content(self, item: dict) -> str:
        if "content" in item:
            return item["content"]
        return fetch(item["path"]).decode() if "path" in item else ""


def plain_text(node: dict) -> str:
    if "value" in node:
        return node["value"]
    return "".join(plain_text(child) for child in node.get("children", []))


def layout(title: str, site_title: str, nav: str, body: str) -> str:
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)} · {esc(site_title)}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="style.css">
</head>
<body>
<header class="top"><a class="brand" href="index.html">{esc(site_title)}</a></header>
<div class="layout">
<main>
{body}</main>
<nav class="toc" aria-label="Chapters">
<p class="toc-title">Chapters</p>
{nav}</nav>
</div>
</body>
</html>
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="render.py", description=__doc__.split("\n\n")[0],
        epilog="Takes no options: jupyter-book sets CONTENT_CDN and BUILD_DIRECTORY (site/build.py runs it).")
    parser.parse_args(argv)  # --help prints this and exits before anything is fetched or written
    if not CDN or "BUILD_DIRECTORY" not in os.environ:
        parser.error("CONTENT_CDN and BUILD_DIRECTORY are not set: `make site` (site/build.py) runs this through "
                     "jupyter-book build --html")
    config = json.loads(fetch("/config.json"))
    project = config["projects"][0]
    site_title = (config.get("options") or {}).get("title") or "ar_lab course"
    index = project["index"]
    pages = [{"slug": index}] + [p for p in project["pages"] if p.get("slug")]
    data = {p["slug"]: json.loads(fetch(f"/content/{p['slug']}.json")) for p in pages}
    # A page's file is named after its source (04_kv_cache.html), not MyST's slug (kv-cache).
    files = {slug: "index.html" if slug == index else Path(d.get("location") or slug).stem + ".html"
             for slug, d in data.items()}
    titles = {slug: d["frontmatter"].get("title") or slug for slug, d in data.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(THEME / "style.css", OUT / "style.css")

    def label(slug: str) -> str:  # the landing page's title is the README's whole first line
        return "The course" if slug == index else titles[slug]

    for number, page in enumerate(pages):
        slug = page["slug"]
        nav = "<ul>\n" + "".join(
            f'<li><a href="{files[s]}"{" aria-current=page" if s == slug else ""}>{esc(label(s))}</a></li>\n'
            for s in files
        ) + "</ul>\n"
        renderer = Page(slug, files, index)
        head = f"<h1>{esc(titles[slug])}</h1>\n"
        location = data[slug].get("location", "")
        if location.endswith(".ipynb") and REPO:
            notebook = Path(location).name
            head += (f'<p class="launch"><a class="binder" href="{esc(binder_url(notebook))}">Open in Binder</a> '
                     f"<span>runs the learner's version of <code>{esc(notebook)}</code>, exercises and widgets "
                     "live</span></p>\n")
        body = head + renderer.node(data[slug]["mdast"])
        steps = []
        if number > 0:
            prev = pages[number - 1]["slug"]
            steps.append(f'<a class="prev" href="{files[prev]}">← {esc(label(prev))}</a>')
        if number + 1 < len(pages):
            nxt = pages[number + 1]["slug"]
            steps.append(f'<a class="next" href="{files[nxt]}">{esc(label(nxt))} →</a>')
        body += f'<footer class="steps">{" ".join(steps)}</footer>\n'
        (OUT / files[slug]).write_text(layout(titles[slug], site_title, nav, body))
    print(f"rendered {len(pages)} pages into {OUT}")


if __name__ == "__main__":
    main()

