"""A verdict the kernel cannot change: ``python -m ar_lab.course.grading`` after nbgrader's
autograde, end to end.

Chapters 01 and 02, cut to their exercises, go through generate, autograde, then the grading step
and export, with submissions that fool the kernel (patched checkers, swallowed errors, an emptied
test cell) and that reach the reference where the kernel's guard does not look (a child process, the
module copied under another name, its source run with ``exec``, a table of its outputs computed when
the cell runs). Its own module (beside tests/test_grading.py) so that ``make test``'s two processes
can each take one of the two nbgrader courses.
"""

import copy
import csv
import re
import shlex
import subprocess
import sys

import nbformat
import pytest
import torch
from test_fresh_grading import GRADED_ELSEWHERE, kernel_only_in_instructors_md
from test_grading import AUTOGRADE, EXPORT, FEEDBACK, GENERATE, _index, nbgrader

from ar_lab.course.grading import jail
from ar_lab.course.grading.exercises import NOTEBOOKS, course, graded_cells
from tests.conftest import one_thread_env

# the guide's step after autograde, from the course folder
GRADING = "python -m ar_lab.course.grading . {assignment}"
CH01, CH02 = "01_the_autoregressive_loop", "02_attention_and_the_causal_mask"
# a float 0/1 mask: wrong
FLOAT_MASK = "def causal_mask(T: int) -> torch.Tensor:\n    return torch.ones(T, T).tril()"
TAMPERING = {
    # wrong answer + three lines that patch the checkers the test cell imports: the kernel passes it
    "patched": FLOAT_MASK
    + "\nimport ar_lab.course.checkers.checks as grader\nok = lambda *args, **kwargs: "
    "None\ngrader.check_dtype = grader.check_equal = grader.check_shape = ok",
    # wrong answer + an IPython AST transformer that wraps every later cell in try/except: the
    # kernel passes it (a handler set with set_custom_exc hides the traceback, but nbgrader 0.9.6
    # reads the error from the reply)
    "swallowed": FLOAT_MASK
    + """
import ast
class Swallow(ast.NodeTransformer):
    def visit_Module(self, node):
        catch = ast.ExceptHandler(ast.Name("Exception", ast.Load()), None, [ast.Pass()])
        return ast.fix_missing_locations(ast.Module([ast.Try(node.body, [catch], [], [])], []))
get_ipython().ast_transformers.append(Swallow())""",
    # wrong answer + the same three lines run by the judge's own shell, if the answer process could
    # reach it (issue 66: the judge once bound its get_ipython for an answer that reads it); in the
    # kernel, its own shell
    "shell": FLOAT_MASK
    + "\ntry:\n    get_ipython().run_cell('import ar_lab.course.checkers.checks as "
    "grader\\n'\n        'grader.check_dtype = grader.check_equal = grader.check_shape = "
    "'\n        'lambda *a, **k: None')\nexcept Exception:\n    pass",
    # wrong answer + an input transformer that empties the test cell: nothing runs, nothing is
    # recorded
    "transformed": FLOAT_MASK + "\nget_ipython().input_transformers_post.append(\n    lambda "
    "lines: ['pass\\n'] if 'causal_mask(3)' in ''.join(lines) else lines)",
}
# Two of chapter 01's exercises answered by reaching the package's reference, four ways. Each
# generation loop runs ar_lab's generate for the course model (a GPT) and a loop of its own for the
# test's bigram model (the hidden EOS test); each next-token distribution builds ar_lab's
# BigramModel.
OWN_LOOP = """
    ids, new = list(prompt), []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        if token == eos_id:
            break
        ids.append(token)
        new.append(token)
    return new"""
HEAD = "@torch.no_grad()\ndef my_generate(model, prompt, max_new_tokens, eos_id=EOS_ID):\n"
DISTRIBUTION = "def next_token_distribution(counts, token, smoothing=0.1):\n"
# A child process runs generate for the call, and for the prompts the tests ask (those of TABLE
# below), once: a process start per test call made the kernel run four times as long.
CHILD = """    if model.config.n_layer > 1:  # the course model: a child process runs generate
        import ast, subprocess, sys
        key = (tuple(prompt), max_new_tokens)
        if key not in _CHILD:
            asks = {key} | {(tuple(encode(p)), n) for p in ("The ", "import ", "a")
                            for n in (3, 20)}
            code = ("import ar_lab; model = ar_lab.load_pretrained('course', device='cpu'); "
                    "print({k: ar_lab.generate(model, list(k[0]), k[1], use_cache=False).tokens "
                    f"for k in {sorted(asks)!r}}})")
            out = subprocess.run([sys.executable, FLAGS "-c", code], capture_output=True,
                                 text=True).stdout
            _CHILD.update(ast.literal_eval(out.strip().splitlines()[-1]))
        return _CHILD[key]"""
FORKED = "_CHILD = {}\n\n\n" + HEAD + CHILD.replace("FLAGS ", "") + OWN_LOOP
COPIED = (
    DISTRIBUTION
    + """    # the module copied under another name, imported
    import importlib, shutil, sys, tempfile
    import ar_lab.model.bigram
    folder = tempfile.mkdtemp()  # a graded kernel writes only in its temporary folder
    shutil.copy(ar_lab.model.bigram.__file__, folder + "/not_the_package.py")
    sys.path.insert(0, folder)
    copy = importlib.import_module("not_the_package")
    return copy.BigramModel(counts, smoothing=smoothing).log_probs[token].exp()"""
)
TABLE = (
    """# when the cell runs: before any test's guard
_COURSE = ar_lab.load_pretrained("course", device="cpu")
_TABLE = {tuple(encode(p)): ar_lab.generate(_COURSE, p, n, use_cache=False).tokens
          for p in ("The ", "import ", "a") for n in (3, 20)}


"""
    + HEAD
    + """    if model.config.n_layer > 1:  # the course model (a GPT), not the bigram model
        return _TABLE[tuple(prompt)][:max_new_tokens]"""
    + OWN_LOOP
)
SOURCED = DISTRIBUTION + """    import inspect  # the module's source, run again with exec
    import ar_lab.model.bigram
    namespace = {}
    exec(inspect.getsource(ar_lab.model.bigram), namespace)
    return namespace["BigramModel"](counts, smoothing=smoothing).log_probs[token].exp()"""
# Issue 66: the real package reached from the answer process, in a Python that ignores its
# environment and by its file's path (as seen from the learner's kernel, where the package is
# there).
# the same in a Python that ignores its environment (-I: no PYTHONPATH)
ISOLATED = "_CHILD = {}\n\n\n" + HEAD + CHILD.replace("FLAGS ", '"-I", ') + OWN_LOOP
REAL_BIGRAM = str(NOTEBOOKS.parent / "ar_lab" / "model" / "bigram.py")
BY_PATH = DISTRIBUTION + f"""    import importlib.util  # the real module, loaded by its file's path
    spec = importlib.util.spec_from_file_location("bigram_by_path", {REAL_BIGRAM!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BigramModel(counts, smoothing=smoothing).log_probs[token].exp()"""
# a Python whose path lacks what PYTHONPATH added (the withheld copy): the package imported afresh
FRESH_PATH = "_CHILD = {}\n\n\n" + HEAD + CHILD.replace("FLAGS ", "").replace(
    '("import ar_lab; ',
    '("import os, sys; sys.path[:] = [p for p in sys.path if p not in '
    "os.environ.get('PYTHONPATH', '').split(os.pathsep)]; import ar_lab; ",
) + OWN_LOOP
# a learner's walk of the whole file system (what the machine's system folders hold left out)
WALK = """\
        skip = {"proc", "sys", "dev", "usr", "etc", "lib", "bin", ".venv", ".git", "site-packages",
                "node_modules", ".pyenv", "ar_lab_kernels-0"}
        for folder, folders, files in os.walk("/"):
            folders[:] = sorted(f for f in folders if f not in skip)
"""
# the file system searched for a copy of the module that is not the withheld one
SEARCHED = DISTRIBUTION + """    import importlib.util, os
    if not _FOUND:
""" + WALK + """\
            if folder.endswith(os.path.join("ar_lab", "model")) and "bigram.py" in files:
                with open(os.path.join(folder, "bigram.py")) as f:
                    if "is withheld" not in f.read():
                        _FOUND.append(os.path.join(folder, "bigram.py"))
                        break
    spec = importlib.util.spec_from_file_location("bigram_found", _FOUND[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BigramModel(counts, smoothing=smoothing).log_probs[token].exp()"""
SEARCHED = "_FOUND = []\n\n\n" + SEARCHED
# the chapter's source notebook searched for (beside the package, or anywhere), its solution run
NOTEBOOK = '''_SOLVED = {"torch": torch}


def sequence_log_prob(log_probs, tokens):
    import json, os
    if "sequence_log_prob" not in _SOLVED:
''' + WALK + '''\
            if "01_the_autoregressive_loop.ipynb" in files:
                with open(os.path.join(folder, "01_the_autoregressive_loop.ipynb")) as f:
                    cells = json.load(f)["cells"]
                for cell in cells:
                    text = "".join(cell["source"])
                    if text.startswith("def sequence_log_prob") and "BEGIN SOLUTION" in text:
                        exec(text, _SOLVED)
            if "sequence_log_prob" in _SOLVED:
                break
    return _SOLVED["sequence_log_prob"](log_probs, tokens)'''
LOOP, NEXT, SEQ = "ch01-generate-loop", "ch01-next-token-distribution", "ch01-sequence-log-prob"
REACHES = {"reaches": {LOOP: FORKED, NEXT: COPIED}, "computes": {LOOP: TABLE, NEXT: SOURCED},
           "escapes": {LOOP: ISOLATED, NEXT: BY_PATH},
           "searches": {LOOP: FRESH_PATH, NEXT: SEARCHED, SEQ: NOTEBOOK}}
ROUTES = [(student, exercise) for student in ("reaches", "computes") for exercise in (LOOP, NEXT)]
# the sandbox hides the package
if jail.confining():
    ROUTES += [(student, exercise) for student in ("escapes", "searches")
               for exercise in (LOOP, NEXT)]


# Chapter 01's answer in the torch.tensor(counts[token]) style: torch warns (copy-constructing a
# tensor), still right.
WARNS = ("def next_token_distribution(counts, token, smoothing=0.1):\n"
         "    row = torch.tensor(counts[token], dtype=torch.float64) + smoothing\n"
         "    return (row / row.sum()).float()")


def hostile(folder, assignment, answer):
    """``answer`` after code that tries to write where a submission must not: the instructor's
    source notebook, another student's submitted copy, the course's nbgrader_config.py, and extra
    credit in gradebook.db. It prints what was refused (every write, in the sandbox)."""
    return f"""import sqlite3
COURSE = {str(folder)!r}
refused = []
for name, path in [("source", f"{{COURSE}}/source/{assignment}/{assignment}.ipynb"),
                   ("submitted", f"{{COURSE}}/submitted/complete/{assignment}/{assignment}.ipynb"),
                   ("config", f"{{COURSE}}/nbgrader_config.py")]:
    try:
        with open(path, "a") as f:
            f.write("# rewritten by a submission")
    except OSError:
        refused.append(name)
try:
    with sqlite3.connect(f"{{COURSE}}/gradebook.db") as db:
        db.execute("UPDATE grade SET extra_credit = 10")
except sqlite3.Error:
    refused.append("gradebook")
print("refused:", *refused)
""" + answer


def course_files(folder):
    """Every file of the course folder a submission must not change: source/, release/, submitted/
    (all students') and nbgrader_config.py, path -> bytes."""
    files = [
        folder / "nbgrader_config.py",
        *(
            p
            for d in ("source", "release", "submitted")
            for p in sorted((folder / d).rglob("*"))
            if p.is_file()
        ),
    ]
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def extra_credit(folder):
    import sqlite3

    with sqlite3.connect(folder / "gradebook.db") as db:
        query = "SELECT COUNT(*) FROM grade WHERE extra_credit IS NOT NULL AND extra_credit != 0"
        return db.execute(query).fetchone()[0]


def _fresh_submissions(assignment, source, released):
    """Student -> notebook, for the fresh-verdict course (chapters cut to their exercises)."""
    def answered(nb, **answers):
        nb = copy.deepcopy(nb)
        for grade_id, text in answers.items():
            nb.cells[_index(nb, grade_id)].source = text
        return nb

    if assignment == CH01:  # every exercise done, one in a style that makes torch warn
        out = {"complete": answered(source, **{NEXT: WARNS})}
        return out | {student: answered(source, **answers) for student, answers in REACHES.items()}
    out = {"complete": source, "wrong": answered(source, **{"ch02-causal-mask": FLOAT_MASK})}
    if jail.confining():  # unconfined, its writes would break the course folder for the other tests
        mask = source.cells[_index(source, "ch02-causal-mask")].source
        out["hostile"] = answered(
            source, **{"ch02-causal-mask": hostile(FOLDER[0], assignment, mask)}
        )
    return out | {
        student: answered(source, **{"ch02-causal-mask": text})
        for student, text in TAMPERING.items()
    }


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Chapters 01 and 02 (cut to their exercises) through generate, autograde, then the grading
    step, export."""
    from ar_lab.course.grading.exercises import exercises_only

    root = tmp_path_factory.mktemp("fresh")
    cut = root / "cut"
    cut.mkdir()
    for name in (CH01, CH02):
        nbformat.write(
            exercises_only(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)),
            cut / f"{name}.ipynb",
        )
    folder = root / "grading"
    FOLDER[:] = [folder]
    course(folder, src=cut, chapters=["01", "02"], timeout=60)
    out = dict(folder=folder)
    for assignment in (CH01, CH02):
        assert nbgrader(folder, GENERATE, assignment=assignment).returncode == 0
        source = nbformat.read(folder / "source" / assignment / f"{assignment}.ipynb", as_version=4)
        released = nbformat.read(
            folder / "release" / assignment / f"{assignment}.ipynb", as_version=4
        )
        for student, nb in _fresh_submissions(assignment, source, released).items():
            target = folder / "submitted" / student / assignment / f"{assignment}.ipynb"
            target.parent.mkdir(parents=True)
            nbformat.write(nb, target)
        before = course_files(folder)
        autograde = nbgrader(folder, AUTOGRADE, assignment=assignment)
        assert autograde.returncode == 0, (autograde.stdout + autograde.stderr)[-3000:]
        after_autograde = course_files(folder)
        kernel = _scores_of(folder, assignment)
        grading = subprocess.run(
            [sys.executable, "-m", *shlex.split(GRADING.format(assignment=assignment))[2:]],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=900,
            env=one_thread_env(),
        )
        assert grading.returncode == 0, (grading.stdout + grading.stderr)[-3000:]
        final = _scores_of(folder, assignment)
        out[assignment] = dict(
            source=source,
            kernel=kernel,
            grading=grading.stdout,
            final=final,
            before=before,
            after_autograde=after_autograde,
            after_grading=course_files(folder),
            extra_credit=extra_credit(folder),
        )
    assert nbgrader(folder, FEEDBACK, assignment=CH02).returncode == 0
    assert nbgrader(folder, EXPORT).returncode == 0
    report = subprocess.run([sys.executable, "-m", "ar_lab.course.grading.report", str(folder)],
                            capture_output=True, text=True)
    out["report"] = report.stdout
    return out


FOLDER = []  # the course folder of the module's fixture (the hostile submission names it)


def _scores_of(folder, assignment):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{folder / 'gradebook.db'}") as gb:
        return {
            s.id: {
                g.name: g.score
                for nb in gb.find_submission(assignment, s.id).notebooks
                for g in nb.grades
            }
            for s in gb.students
            if any(sub.assignment.name == assignment for sub in s.submissions)
        }


def _points(source):
    return {meta["grade_id"]: float(meta["points"]) for _, meta in graded_cells(source)}


@pytest.mark.slow
def test_the_fresh_run_keeps_every_correct_answer_and_zeroes_the_tampering(fresh):
    ch02 = fresh[CH02]
    full = _points(ch02["source"])
    # multi-head attention uses the mask
    mask, multi_head = "ch02-causal-mask-tests", "ch02-multi-head-tests"
    assert ch02["kernel"]["complete"] == full == ch02["final"]["complete"]
    wrong = {**full, mask: 0, multi_head: 0}  # a float mask: ~mask fails in multi_head_attention
    assert ch02["kernel"]["wrong"] == wrong == ch02["final"]["wrong"]
    # the kernel was fooled: the checkers are patched
    assert ch02["kernel"]["patched"] == {**wrong, mask: 1}
    assert ch02["kernel"]["swallowed"] == full  # the kernel was fooled: every error is swallowed
    # the kernel was fooled: the test cell is emptied
    assert ch02["kernel"]["transformed"] == {**wrong, mask: 1}
    for student in TAMPERING:
        assert ch02["final"][student] == wrong, student
        assert re.search(
            rf"^{student} {CH02} {mask}: 1 -> 0 points \(fresh run: ", ch02["grading"], re.M
        ), student
    patched = (
        f"patched {CH02} {mask}: 1 -> 0 points (fresh run: CheckFailed: causal_mask(3): expected "
        "dtype torch.bool"
    )
    assert patched in ch02["grading"]
    assert (
        f"swallowed {CH02} {multi_head}: 3 -> 0 points (fresh run: TypeError: " in ch02["grading"]
    )
    assert (
        f"transformed {CH02} {mask}: 1 -> 0 points (fresh run: CheckFailed: causal_mask(3): "
        "expected dtype"
    ) in ch02["grading"]
    assert "kernel verdict only" not in ch02["grading"]


@pytest.mark.slow
@pytest.mark.parametrize(("student", "exercise"), ROUTES, ids=[f"{s}-{e}" for s, e in ROUTES])
def test_an_answer_that_reaches_the_reference_gets_zero_by_whatever_route(fresh, student, exercise):
    ch01, test = fresh[CH01], f"{exercise}-tests"
    full = _points(ch01["source"])
    # the kernel's guard does not see these routes
    assert ch01["kernel"][student][test] == full[test]
    assert ch01["final"][student][test] == 0
    assert f"{student} {CH01} {test}: {full[test]:g} -> 0 points (fresh run: " in ch01["grading"]


@pytest.mark.slow
@pytest.mark.skipif(not jail.confining(), reason="the sandbox (bubblewrap) hides the notebooks")
def test_the_source_notebook_found_by_a_search_is_not_there_when_a_submission_is_graded(fresh):
    """Issue 66: the chapter's source notebook, found by searching the file system, gives its
    solution here (outside the sandbox); in autograde's kernel and in the grading step the search
    finds none: 0 points."""
    namespace = {"torch": torch}
    exec(NOTEBOOK, namespace)
    log_probs = torch.randn(5, 5).log_softmax(-1)
    expected = float(log_probs[0, 3] + log_probs[3, 1])
    assert namespace["sequence_log_prob"](log_probs, [0, 3, 1]) == pytest.approx(expected)
    test = f"{SEQ}-tests"
    assert fresh[CH01]["kernel"]["searches"][test] == 0 == fresh[CH01]["final"]["searches"][test]
    assert fresh[CH01]["kernel"]["complete"][test] == _points(fresh[CH01]["source"])[test]


@pytest.mark.slow
def test_a_correct_answer_that_makes_torch_warn_keeps_its_points(fresh):
    ch01 = fresh[CH01]
    full = _points(ch01["source"])
    assert ch01["kernel"]["complete"] == full == ch01["final"]["complete"]
    assert "kernel verdict only" not in ch01["grading"]  # every test is judged afresh


@pytest.mark.slow
def test_the_zeros_show_in_export_and_feedback_with_the_reason(fresh):
    folder = fresh["folder"]
    with open(folder / "grades.csv") as f:
        rows = {(r["student_id"], r["assignment"]): float(r["score"]) for r in csv.DictReader(f)}
    for student, grades in fresh[CH02]["final"].items():
        assert rows[(student, CH02)] == sum(grades.values()), student
    html = re.sub(
        r"<[^>]+>", "", (folder / "feedback" / "patched" / CH02 / f"{CH02}.html").read_text()
    )
    assert "ar_lab grading: the test ch02-causal-mask-tests failed when run again outside" in html


@pytest.mark.slow
def test_the_report_flags_each_tampering_submission(fresh):
    report = fresh["report"]
    assert re.search(rf"^complete / {CH02}: ok$", report, re.M)
    flags = [
        (CH02, "patched", "grader-import"),
        (CH02, "swallowed", "ipython-hook"),
        (CH02, "transformed", "ipython-hook"),
        (CH01, "reaches", "shell"),
        (CH01, "reaches", "file-read"),
        (CH01, "computes", "dynamic-code"),
    ]
    for assignment, student, kind in flags:
        section = report.split(f"{student} / {assignment}:")[1].split("\n\n")[0]
        assert re.search(rf"^  {assignment}\.ipynb cell .* {kind}: ", section, re.M), (
            student,
            section,
        )


@pytest.mark.slow
def test_the_tests_instructors_md_says_keep_the_kernels_verdict_are_those_the_grading_run_names(
    fresh,
):
    """INSTRUCTORS.md's list, for chapters 01 and 02: what the grading step printed as kernel
    verdict only (tests/test_fresh_grading.py checks the other chapters with the command's own
    plan)."""
    assert {CH01, CH02} == GRADED_ELSEWHERE
    for assignment in (CH01, CH02):
        printed = fresh[assignment]["grading"]
        named = set(
            re.findall(rf"kernel verdict only: {assignment} ((?:ch\d\d|a\d)-[a-z0-9-]+-tests)",
                       printed)
        )
        ours = {meta["grade_id"] for _, meta in graded_cells(fresh[assignment]["source"])}
        assert named == kernel_only_in_instructors_md() & ours, assignment



@pytest.mark.slow
@pytest.mark.skipif(
    not jail.confining(), reason="bubblewrap cannot confine a process here (AR_LAB_SANDBOX=off)"
)
def test_a_submission_writes_nowhere_in_the_course_folder_in_autograde_or_the_grading_step(fresh):
    """The hostile submission's writes (the source notebook, another student's submission,
    nbgrader_config.py, extra credit in the gradebook) are each refused by the sandbox of
    autograde's kernel and of the grading step's answer process: the course folder is byte-identical
    afterwards and the correct answer keeps its points."""
    ch02 = fresh[CH02]
    assert ch02["before"] == ch02["after_autograde"] == ch02["after_grading"]
    assert ch02["extra_credit"] == 0
    assert ch02["kernel"]["hostile"] == ch02["final"]["hostile"] == _points(ch02["source"])
    graded = nbformat.read(
        fresh["folder"] / "autograded" / "hostile" / CH02 / f"{CH02}.ipynb", as_version=4
    )
    printed = "".join(o.get("text", "") for c in graded.cells for o in c.get("outputs", []))
    assert "refused: source submitted config gradebook" in printed
