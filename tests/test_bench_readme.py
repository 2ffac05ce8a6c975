"""The README's benchmark and checkpoint tables are generated, and a hand edit fails the tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ar_lab.base.errors import BadValue
from ar_lab.bench import readme
from ar_lab.model.checkpoint import load_checkpoint
from tests.raising import raises

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _copy_root(tmp_path: Path) -> Path:
    """A folder with the README and the data the tables are generated from."""
    (tmp_path / "data").mkdir()
    shutil.copytree(ROOT / "data" / "bench", tmp_path / "data" / "bench")
    for name in ("course.safetensors", "modern.safetensors", "draft.safetensors"):
        shutil.copy(ROOT / "data" / name, tmp_path / "data" / name)
    shutil.copy(README, tmp_path / "README.md")
    return tmp_path


def test_readme_tables_are_what_the_json_and_checkpoints_say():
    text = README.read_text()
    assert readme.render(text, ROOT) == text, "README is stale: run python -m ar_lab.bench.readme"


def test_every_benchmark_json_records_its_command_and_machine():
    for name in readme.ROWS:
        res = json.loads((ROOT / "data" / "bench" / f"{name}.json").read_text())
        assert res["command"].startswith(f"python -m ar_lab.bench {name} "), res["command"]
        machine = res["settings"][0]["machine"] if "settings" in res else res["machine"]
        assert machine["date"][:4].isdigit() and machine["device"]["cpus"] >= 1


def test_a_new_measurement_changes_the_table(tmp_path):
    root = _copy_root(tmp_path)
    path = root / "data" / "bench" / "sampler.json"
    res = json.loads(path.read_text())
    res["samplers"]["greedy"]["ratio_to_decode_step"] = 0.4321
    path.write_text(json.dumps(res))
    table = readme.bench_table(root / "data" / "bench")
    assert "greedy 43.2%" in table
    assert readme.render(README.read_text(), root) != README.read_text()


def test_a_hand_typed_figure_fails_the_check(tmp_path, capsys):
    root = _copy_root(tmp_path)
    page = root / "README.md"
    text = page.read_text()
    start = text.index(readme.BENCH_START)
    row = text.index("| `python -m ar_lab.bench serving` |", start)
    end = text.index("\n", row)
    page.write_text(
        text[:row] + "| `python -m ar_lab.bench serving` | typed | 99× faster |" + text[end:]
    )
    assert readme.main(["--readme", str(page), "--check"]) == 1
    assert "99× faster" in capsys.readouterr().out  # the diff shows the typed line
    assert readme.main(["--readme", str(page)]) == 0  # regenerating repairs it
    assert page.read_text() == text


def test_missing_json_and_markers_are_clear_errors(tmp_path):
    root = _copy_root(tmp_path)
    (root / "data" / "bench" / "speculative.json").unlink()
    with pytest.raises(FileNotFoundError, match="python -m ar_lab.bench speculative --json"):
        readme.bench_table(root / "data" / "bench")
    with raises(BadValue, 'readme'):
        readme.render("no markers here", ROOT)
    with pytest.raises(SystemExit) as e:
        readme.main(["--readme", str(tmp_path / "nothing.md"), "--check"])
    assert e.value.code == 2


def test_checkpoint_rows_agree_with_the_models():
    table = readme.checkpoint_table(
        [ROOT / "data" / f"{name}.safetensors" for name in ("course", "modern", "draft")]
    )
    for name in ("course", "modern", "draft"):
        model = load_checkpoint(ROOT / "data" / f"{name}.safetensors", device="cpu")
        cfg = model.config
        row = next(line for line in table.splitlines() if f"`{name}.safetensors`" in line)
        assert f"| {model.num_parameters():,} |" in row
        assert f"{cfg.n_layer} × {cfg.n_embd}, {cfg.n_head} heads" in row
    assert "distils the course model" in table  # the draft's third phase has a teacher
