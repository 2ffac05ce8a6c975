"""``python -m ar_lab.bench attention`` at tiny sizes (structure, not speed); its exponent fits."""

from __future__ import annotations

import json

import pytest

from ar_lab.base.errors import BadValue
from ar_lab.bench.__main__ import main
from ar_lab.bench.attention import (
    attention_benchmark,
    exponent,
    format_attention_results,
    growth_exponent,
)
from tests.raising import raises


def test_exponents_of_known_curves():
    T = [64, 128, 256, 512]
    assert exponent(T, [3 * t**2 for t in T]) == pytest.approx(2)
    assert (
        exponent(T, [1000 + t for t in T]) < 0.5
    )  # a fixed part flattens the fit over the values...
    assert growth_exponent(T, [1000 + t for t in T]) == pytest.approx(1)  # ...not over their growth
    assert growth_exponent(T, [7 + 5 * t + t**2 for t in T]) == pytest.approx(2, abs=0.02)
    assert (
        growth_exponent([64, 128, 384], [1, 2, 3]) is None
    )  # the lengths do not grow by one ratio
    assert growth_exponent(T, [4, 3, 2, 1]) is None


def test_attention_benchmark_returns_data_and_prints_nothing(capsys):
    res = attention_benchmark(
        memory_lengths=(64, 128, 256),
        time_lengths=(32, 64),
        heads=2,
        kv_heads=1,
        head_dim=16,
        tile=16,
        rounds=1,
    )
    assert capsys.readouterr().out == ""
    assert json.loads(json.dumps(res)) == res
    assert [r["T"] for r in res["memory"]] == [64, 128, 256] and [r["T"] for r in res["time"]] == [
        32,
        64,
    ]
    g = res["growth_exponents"]
    assert g["materialised"] == pytest.approx(2, abs=0.1) and g["tiled"] == pytest.approx(
        1, abs=0.01
    )
    assert res["exponents"]["materialised"] > 1.5 > res["exponents"]["tiled"]
    for r in res["time"]:
        assert set(r["seconds"]) == {"materialised", "tiled", "sdpa"}
        assert r["ratio_to_sdpa"]["tiled"] == pytest.approx(
            r["seconds"]["tiled"] / r["seconds"]["sdpa"]
        )
        assert r["max_abs_difference"] < 1e-4
    table = format_attention_results(res)
    assert "tiled/sdpa" in table and "fitted over T" in table and "peak(rT) - peak(T)" in table


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        (dict(kv_heads=3), "kv_heads"),
        (dict(memory_lengths=(64,)), "memory_lengths"),
        (dict(time_lengths=(32, 32)), "time_lengths"),
        (dict(time_lengths=(0, 32)), "time_lengths"),
        (dict(tile=0), "tile"),
        (dict(rounds=0), "rounds"),
    ],
)
def test_attention_benchmark_refuses_bad_options(kwargs, arg):
    with raises(BadValue, arg):
        attention_benchmark(**kwargs)


def test_the_command_writes_its_json(tmp_path, capsys):
    path = tmp_path / "attention.json"
    assert main(["attention", "--quick", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["command"] == f"python -m ar_lab.bench attention --quick --json {path}"
    assert res["benchmark"] == "attention" and "machine" in res
    assert "materialised / tiled" in capsys.readouterr().out


def test_a_bad_option_ends_with_one_message(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["attention", "--kv-heads", "3"])
    assert stop.value.code == 2
    assert "attention: kv_heads" in capsys.readouterr().err.splitlines()[-1]
