"""Build the course's static site with Jupyter Book 2: ``make site`` runs ``python site/build.py``.

Writes the MyST project into build/site/ (never into notebooks/): the student version of every
notebook, as a learner gets it (``ar_lab.course.grading.exercises.student_version``: solutions stubbed, hidden
tests removed), with the committed outputs of every cell but the answer cells; the glossary; index.md,
the landing page, made from README.md (its start and the course map) so the two cannot drift; and
myst.yml (site/myst.yml with the table of contents written from notebooks/). Then it runs
``jupyter-book build --html`` there, which renders through site/theme/. Nothing is executed.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "build" / "site"
HTML = OUT / "_build" / "html"
GLOSSARY = "glossary.md"
NODE_MAJORS = (18, 20, 22)  # what jupyter-book 2 runs on (22 and newer too)
NEED_NODE = "make site needs Node.js 18, 20 or 22+ (node and npm): apt-get install nodejs npm, or https://nodejs.org"


YOURS = re.compile(r"^▶ this runs on your .*\n?", re.M)  # a line the solution's run printed


def site_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student version of ``nb`` with the committed outputs of every cell that is neither an answer
    cell nor a graded test (whose saved output is the solution passing, under a stub), without the
    lines that say a cell ran on the learner's piece (the stub's page has none)."""
    from ar_lab.course.grading.exercises import nbgrader_meta, student_version  # imports torch: not before check_node

    page = student_version(nb)
    for source, cell in zip(nb.cells, page.cells, strict=True):
        meta = nbgrader_meta(source)
        if cell.cell_type == "code" and not meta.get("solution") and not meta.get("grade"):
            cell.outputs = copy.deepcopy(source.get("outputs", []))
            for out in cell.outputs:
                if out.get("output_type") == "stream":
                    out["text"] = YOURS.sub("", "".join(out["text"]))
            cell.outputs = [o for o in cell.outputs if o.get("output_type") != "stream" or o["text"]]
            cell.execution_count = source.get("execution_count")
    return page


def github_slug(heading: str) -> str:
    """The anchor GitHub and JupyterLab give a heading ("FLOP/s" -> "flops"), which the course's links use."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def glossary_page(text: str) -> str:
    """The glossary with an explicit MyST label on every term, the anchor the chapters link to: MyST's own
    slugs differ where a term holds punctuation ("FLOP/s", "torch.compile")."""
    return re.sub(r"^(#{2,6}) (.+)$", lambda m: f"({github_slug(m.group(2))})=\n{m.group(0)}", text, flags=re.M)


def chapters(src: Path = NOTEBOOKS) -> list[Path]:
    """Every notebook of the course, in the course's order (00 ... 09 with the b parts, then the appendix)."""
    return sorted(src.glob("*.ipynb"))


def landing_page(readme: str, notebooks: list[str], repo_url: str) -> str:
    """README.md from its start to the end of the course map, as the site's first page.

    A notebook named in a table's first column links to its page; links into notebooks/ point at the
    pages beside it; other files of the repository link to the repository; HTML comments go."""
    end = re.search(r"^## The package", readme, re.M)
    text = readme[: end.start()] if end else readme
    text = re.sub(r"<!--.*?-->\n?", "", text, flags=re.S)

    def notebook_link(match: re.Match) -> str:
        name = match.group(1)
        return f"| [`{name}`]({name}.ipynb) |" if name in notebooks else match.group(0)

    text = re.sub(r"^\| `([0-9A-Za-z_]+)` \|", notebook_link, text, flags=re.M)
    text = text.replace("](notebooks/", "](")

    def repo_link(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if target.startswith(("http://", "https://", "#")) or (NOTEBOOKS / target.split("#")[0]).exists():
            return match.group(0)
        return f"[{label}]({repo_url.rstrip('/')}/blob/main/{target})"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", repo_link, text).rstrip() + "\n"


def config(notebooks: list[Path], repo_url: str) -> dict:
    """site/myst.yml with the table of contents: the landing page, every notebook, the glossary."""
    conf = yaml.safe_load((SITE / "myst.yml").read_text())
    conf["project"]["github"] = repo_url
    toc = [{"file": "index.md"}] + [{"file": nb.name} for nb in notebooks]
    if (NOTEBOOKS / GLOSSARY).is_file():
        toc.append({"file": GLOSSARY})
    conf["project"]["toc"] = toc
    return conf


def check_node() -> None:
    """Exit with one line saying what to install when Node.js is missing or too old."""
    node = shutil.which("node")
    if node is None:
        sys.exit(NEED_NODE)
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    major = re.match(r"v(\d+)", version)
    if not major or not (int(major.group(1)) in NODE_MAJORS or int(major.group(1)) > NODE_MAJORS[-1]):
        sys.exit(f"{NEED_NODE} (found {version or 'an unreadable version'})")


def github_url(remote: str) -> str | None:
    """https://github.com/OWNER/REPO for a GitHub remote (https or ssh form), else None."""
    found = re.match(r"^(?:https://github\.com/|git@github\.com:|ssh://git@github\.com/)([\w.-]+)/([\w.-]+?)(?:\.git)?/?$",
                     remote.strip())
    return f"https://github.com/{found.group(1)}/{found.group(2)}" if found else None


def repository_url() -> str:
    """Where the Binder links point: AR_LAB_REPO_URL, else project.github in site/myst.yml unless it is the
    placeholder, else the clone's GitHub remote (origin), else the placeholder (the build says so)."""
    project = yaml.safe_load((SITE / "myst.yml").read_text())["project"]
    configured = os.environ.get("AR_LAB_REPO_URL") or project["github"]
    if "/OWNER/" not in configured:
        return configured
    remote = subprocess.run(["git", "-C", str(ROOT), "remote", "get-url", "origin"], capture_output=True, text=True)
    return (github_url(remote.stdout) if remote.returncode == 0 else None) or configured


def write_project(out: Path = OUT) -> tuple[list[Path], str]:
    """Lay out the MyST project in ``out``; returns the notebooks it holds and the repository's URL."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(SITE / "theme", out / "theme", ignore=shutil.ignore_patterns("__pycache__"))
    repo_url = repository_url()
    if "/OWNER/" in repo_url:
        print(f"note: the Binder links use the placeholder {repo_url}: set project.github in site/myst.yml "
              "(or AR_LAB_REPO_URL) to the repository's URL before publishing")
    notebooks = chapters()
    for path in notebooks:
        nbformat.write(site_notebook(nbformat.read(path, as_version=4)), out / path.name)
    if (NOTEBOOKS / GLOSSARY).is_file():
        (out / GLOSSARY).write_text(glossary_page((NOTEBOOKS / GLOSSARY).read_text()))
    readme = (ROOT / "README.md").read_text()
    (out / "index.md").write_text(landing_page(readme, [p.stem for p in notebooks], repo_url))
    (out / "myst.yml").write_text(yaml.safe_dump(config(notebooks, repo_url), sort_keys=False, allow_unicode=True))
    return notebooks, repo_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python site/build.py", description=__doc__.split("\n\n")[0],
        epilog=f"The pages go to {HTML.relative_to(ROOT)}; {OUT.relative_to(ROOT)} is emptied first. Needs Node.js "
               f"{', '.join(map(str, NODE_MAJORS[:-1]))} or {NODE_MAJORS[-1]}+.")
    parser.parse_args(argv)  # no options: --help prints this and exits before anything is built or removed
    check_node()
    start = time.perf_counter()
    notebooks, repo_url = write_project()
    # JB_ALLOW_NODEENV=no: jupyter-book never downloads a Node.js of its own. npm_config_registry: MyST asks the
    # npm registry whether a newer mystmd exists; a closed loopback port answers at once, so a build reaches
    # no network. No BASE_URL: the pages link to each other relatively.
    env = {**os.environ, "JB_ALLOW_NODEENV": "no", "npm_config_registry": "http://127.0.0.1:9/",
           "AR_LAB_SITE_PYTHON": sys.executable, "AR_LAB_SITE_REPO": repo_url}
    env.pop("BASE_URL", None)
    run = subprocess.run([sys.executable, "-m", "jupyter_book", "build", "--html"], cwd=OUT, env=env)
    if run.returncode or not (HTML / "index.html").is_file():
        print(f"jupyter-book build failed (exit status {run.returncode})", file=sys.stderr)
        return run.returncode or 1
    pages = len(list(HTML.glob("*.html")))
    print(f"site: {pages} pages ({len(notebooks)} notebooks) in {HTML.relative_to(ROOT)} "
          f"in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
