"""Issue 66: a correct answer that the learner's kernel passes gets its points from the grading
step's judge too, whatever its style: the judge compares what the kernel compares.

Three styles the judge once rejected while the kernel passed them, each judged as the grading step
judges (``ar_lab.course.grading.judge``: the test in a fresh kernel, the answer in its own
process), beside a wrong answer of the same style, which must still fail. Then the cause, one
write at a time: a tensor crosses as a copy (``ar_lab.course.grading.lending``), and a write into
a copy the learner's code has already dropped, into a temporary that shares the original's
storage, or through ``.data``, must land in the original as it would in one process.
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch

from ar_lab.course.grading import judge as grading
from ar_lab.course.grading import sandbox
from ar_lab.course.grading.cells import cut
from ar_lab.course.grading.channel import CURRENT
from ar_lab.course.grading.exercises import nbgrader_meta
from ar_lab.course.grading.judge import Plan, judge_notebook
from ar_lab.course.grading.sandbox import answer

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def judged(chapter: str, exercise: str, right: str, wrong: str, folder: Path) -> tuple:
    """(the judge's verdict on ``right``, its verdict on ``wrong``) as answers to ``exercise`` of
    ``chapter``: the chapter cut to that exercise, then the exercise again under another grade id
    answered ``wrong`` (its answer process runs the cells before it: the wrong answer rebinds the
    names), so that one judge kernel gives both verdicts."""
    path = NOTEBOOKS / f"{chapter}.ipynb"
    ids = (exercise, f"{exercise}-tests")
    source = cut(nbformat.read(path, as_version=4),
                 lambda c: nbgrader_meta(c).get("grade_id") in ids)
    again = [copy.deepcopy(c) for c in source.cells if nbgrader_meta(c).get("grade_id") in ids]
    for cell in again:
        meta = cell.metadata["nbgrader"]
        meta["grade_id"] = meta["grade_id"].replace(exercise, f"{exercise}-wrong")
        cell["id"] = f"{cell['id'][:50]}-wrong"
    source.cells += again
    submission = copy.deepcopy(source)
    for cell in submission.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in (exercise, f"{exercise}-wrong"):
            cell.source = textwrap.dedent(right if gid == exercise else wrong).strip()
    nbformat.write(submission, folder / path.name)
    judge, tests, answers = judge_notebook(source)
    fresh = grading.judge(Plan(chapter, source, judge, tests, {}, answers), folder, timeout=300)
    return fresh[f"{exercise}-tests"], fresh[f"{exercise}-wrong-tests"]


# Chapter 03: the course model's weights copied into MyGPT by name, and greedy growing a tensor.
LOADER = """
    def greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])  # (1, T), one token longer each step
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, model(ids)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return ids[0, len(prompt):].tolist()


    your_course_gpt = MyGPT(course.config)
    theirs = dict(course.named_parameters())
    with torch.no_grad():
        for name, p in your_course_gpt.named_parameters():
            {copy}
    your_course_gpt.eval();
"""

# Chapter 04: the cache written by slice assignment, the causal mask an additive triu of -inf.
CACHED = """
    def cached_attention(attn: nn.Module, x: torch.Tensor, cache, layer: int, start: int):
        B, T, C = x.shape
        H = attn.n_head
        q, k, v = (t.view(B, T, H, C // H){heads} for t in attn.qkv(x).split(C, dim=-1))
        if cache is not None:
            cache.k[layer][:, :, start:start + T] = k
            cache.v[layer][:, :, start:start + T] = v
            k, v = cache.k[layer][:, :, :start + T], cache.v[layer][:, :, :start + T]
        future = torch.full((T, start + T), float("-inf"), device=x.device).triu(diagonal=start + 1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // H) + future, dim=-1)
        return attn.proj((weights @ v).transpose(1, 2).reshape(B, T, C))
"""

# Chapter 05: the probes' timer a closure that keeps the running best.
PROBES = """
    def fastest(fn, repeats: int) -> float:
        best = math.inf

        def timed() -> None:
            nonlocal best
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)

        fn()
        for _ in range(repeats):
            timed()
        return best{unit}


    def stream_probe(n: int, repeats: int = 5) -> tuple[int, float]:
        a, b, c = (torch.rand(n, device=device, dtype=dtype) for _ in range(3))
        return 3 * a.nbytes, fastest(lambda: torch.add(a, b, out=c), repeats)


    def matmul_probe(m: int, k: int, n: int, repeats: int = 5) -> tuple[int, float]:
        a = torch.rand(m, k, device=device, dtype=dtype)
        b = torch.rand(k, n, device=device, dtype=dtype)
        return 2 * m * k * n, fastest(lambda: a @ b, repeats)
"""

STYLES = {
    "ch03": ("03b_train_a_gpt", "ch03-course-model",
             LOADER.replace("{copy}", "p.copy_(theirs[name])"),
             LOADER.replace("{copy}", "p.copy_(theirs[name]) if name != 'wpe.weight' else None"),
             "values differ"),
    "ch04": ("04_kv_cache", "ch04-cached-attention", CACHED.replace("{heads}", ".transpose(1, 2)"),
             CACHED.replace("{heads}", ""), "RuntimeError"),  # it fails on its 2nd call
    "ch05": ("05_prefill_vs_decode", "ch05-probes", PROBES.replace("{unit}", ""),
             PROBES.replace("{unit}", " * 1e3"), "milliseconds"),
}


@pytest.mark.slow
@pytest.mark.parametrize("style", [
    "ch03", "ch04",
    pytest.param("ch05", marks=pytest.mark.quiet),  # it times the probes against ar_lab's: alone
])
def test_a_correct_style_gets_its_points_from_the_judge_and_a_wrong_one_does_not(style, tmp_path):
    """03: parameters copied by name from ``named_parameters()``, greedy growing with
    ``torch.cat``; 04: the cache written by slices, an additive ``triu`` mask; 05: a closure
    keeping the running best.
    The wrong ones: a parameter left out, heads split without moving them before the positions (it
    fails on its second call: the test stays short), seconds x 1,000."""
    chapter, exercise, right, wrong, why = STYLES[style]
    good, bad = judged(chapter, exercise, right, wrong, tmp_path)
    assert good.passed, f"{exercise}: a correct answer fails the judge: {good.error[-600:]}"
    assert not bad.passed, f"{exercise}: a wrong answer passes the judge"
    assert why in bad.error, f"{exercise}: the wrong answer failed otherwise: {bad.error[-600:]}"


# -- the cause: writes into a tensor that crossed as a copy -----------------------------------

WRITERS = textwrap.dedent("""
    import torch

    def by_name(mine, theirs):  # each parameter's copy is dropped once written
        named = dict(theirs.named_parameters())
        with torch.no_grad():
            for name, p in mine.named_parameters():
                p.copy_(named[name])

    def into_state_dict(mine, theirs):  # the judge's state_dict(): temporaries of its parameters
        state = theirs.state_dict()
        for name, t in mine.state_dict().items():
            t.copy_(state[name])

    def through_data(mine, theirs):  # .data moves no version counter
        for p, q in zip(mine.parameters(), theirs.parameters()):
            p.data.copy_(q.data)

    def rebinding_data(mine, theirs):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            p.data = q.data.clone()

    def by_slices(holder, start, k):  # the buffer read afresh for each write
        holder.k[0][:, start:start + k.shape[1]] = k
        return holder.k[0][:, :start + k.shape[1]].sum()

    def keep(model):  # a copy the answer holds on to, never written
        global kept
        kept = next(model.parameters())

    def poke():
        return float(kept.sum())
""")


@pytest.fixture(scope="module")
def writer(tmp_path_factory):
    errors = sandbox.start([WRITERS], [], tmp_path_factory.mktemp("fair") / "answer")
    assert errors == [""]
    yield
    sandbox.stop()


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    nn = torch.nn
    return tuple(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)) for _ in "ab")


@pytest.mark.parametrize("route", ["by_name", "into_state_dict", "through_data", "rebinding_data"])
def test_a_write_into_a_copy_reaches_the_original_by_every_route(writer, route):
    mine, theirs = _models()
    pairs = list(zip(mine.parameters(), theirs.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in pairs)
    answer(route)(mine, theirs)
    for (name, a), b in zip(mine.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), f"{route}: {name} did not reach the judge's model"


class Holder:
    def __init__(self):
        self.k = [torch.zeros(2, 6)]


def test_a_buffer_written_by_slices_through_a_handle_keeps_every_write(writer):
    holder = Holder()
    assert answer("by_slices")(holder, 0, torch.ones(2, 3)) == 6.0  # its own write, read back
    assert answer("by_slices")(holder, 3, torch.full((2, 2), 2.0)) == 14.0
    assert holder.k[0].tolist() == [[1.0, 1.0, 1.0, 2.0, 2.0, 0.0]] * 2
    buffer = holder.k[0].untyped_storage().data_ptr()  # the answer let its copies go: the judge too
    kept = CURRENT["channel"].ledger.kept.values()
    assert not [t for t in kept if t.untyped_storage().data_ptr() == buffer]


def test_a_copy_never_written_never_overwrites_the_original(writer):
    mine, _ = _models()
    answer("keep")(mine)
    with torch.no_grad():
        next(mine.parameters()).fill_(3.0)  # the judge's own change, after the answer took its copy
    answer("poke")()  # a message from the answer, which still holds its (unwritten) copy
    assert torch.equal(next(mine.parameters()), torch.full((4, 3), 3.0))
