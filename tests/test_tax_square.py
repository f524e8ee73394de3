"""benchmarks/tax_square.py: each row paired with the plain row of its GPU and round, and of its time slot."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("tax_square", REPO / "benchmarks" / "tax_square.py")
tax_square = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tax_square)


def _main(monkeypatch, folder):
    monkeypatch.setattr(sys, "argv", ["tax_square.py", str(folder)])
    tax_square.main()


def _write(folder, where, rows):
    (folder / where).mkdir(parents=True)
    result = {"command": f"zerotrain benchmark imdb --out {where}", "rows": rows,
              "environment": {"gpus": ["GPU"], "versions": {"torch": "t", "deepspeed": "d"}, "commit": "abc"}}
    (folder / where / "benchmark.json").write_text(json.dumps(result))


def _row(strategy, ms, wall_s=10.0, steps=100, rnd=None, status="ok", started=None):
    row = {"strategy": strategy, "status": status, "throughput_sec_per_step": ms / 1000, "wall_s": wall_s,
           "throughput_measured_steps": steps, "throughput_host_cpu_frac": 0.5}
    if rnd is not None:
        row["round"] = rnd
    if started is not None:
        row["started_unix"] = started
    return row


def _engine(s, name):
    return next(e for e in s["engines"] if e["strategy"] == name)


def test_one_sweep_per_gpu_pairs_by_gpu_and_round_and_by_overlapping_timed_steps(tmp_path, monkeypatch):
    # Sweeps started together; rows end at the sums of wall_s, their timed steps last the ends' last steps x s/step.
    # GPU 0: ddp timed 9.0-10.0 s, zero0 18.35-20.0, zero1 timed 69.0-70.0 (after a slow 50 s fit: no plain then).
    # GPU 1: zero0 timed 7.8-10.0, ddp 17.0-20.0, then a failed row.
    _write(tmp_path, "gpu0", [_row("ddp", 10.0, rnd=1), _row("zero0", 16.5, rnd=1), _row("zero1", 10.0, 50.0, rnd=1)])
    _write(tmp_path, "gpu1", [_row("zero0", 22.0, rnd=1), _row("ddp", 30.0, rnd=1),
                              _row("zero1", 1.0, rnd=1, status="failed")])
    _main(monkeypatch, tmp_path)
    s = json.loads((tmp_path / "tax_square.json").read_text())
    zero0 = _engine(s, "zero0")
    # same GPU and round: 16.5/10 - 1 and 22/30 - 1
    assert zero0["tax_same_gpu"]["n"] == 2
    assert zero0["tax_same_gpu"]["lowest"] == pytest.approx(22 / 30 - 1)
    assert zero0["tax_same_gpu"]["highest"] == pytest.approx(0.65)
    # at the same time: GPU 1's zero0 against GPU 0's ddp (22/10 - 1), GPU 0's zero0 against GPU 1's ddp
    assert zero0["tax_same_time"]["n"] == 2
    assert sorted(zero0["tax_same_time"][k] for k in ("lowest", "highest")) == pytest.approx([16.5 / 30 - 1, 1.2])
    # zero1 ran when no plain row did: paired on its GPU and round only; the failed row is left out
    assert _engine(s, "zero1")["tax_same_gpu"]["n"] == 1 and _engine(s, "zero1")["tax_same_time"] is None
    assert [e["strategy"] for e in s["engines"]] == ["ddp", "zero0", "zero1"]
    assert s["median_ms_per_gpu"] == {"0": pytest.approx(10.0), "1": pytest.approx(26.0)}
    md = (tmp_path / "tax_square.md").read_text()
    assert "commit abc" in md and "zerotrain benchmark imdb --out gpu0" in md
    assert "| zero0 | 2 | 19.25 |" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tax_square.png").stat().st_size > 0


def test_one_fit_per_slot_takes_rounds_from_the_slots_and_times_from_the_rows(tmp_path, monkeypatch):
    # Two engines, two rounds, two GPUs, every slot started together (started_unix); GPU 1's order reversed.
    for g, order in ((0, ["ddp", "zero0", "zero0", "ddp"]), (1, ["zero0", "ddp", "ddp", "zero0"])):
        for t, name in enumerate(order):
            ms = {"ddp": 10.0, "zero0": 11.0}[name] * (2 if t >= 2 else 1)  # the machine slows in round 2
            _write(tmp_path, f"gpu{g}/slot{t}", [_row(name, ms, started=1000.0 + 100 * t)])
    _main(monkeypatch, tmp_path)
    s = json.loads((tmp_path / "tax_square.json").read_text())
    assert sorted({(r["gpu"], r["round"]) for r in s["rows"]}) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    zero0 = _engine(s, "zero0")
    for pairing in ("tax_same_gpu", "tax_same_time"):  # every pair ran in one round: +10% each time
        assert zero0[pairing]["n"] == 4
        assert zero0[pairing]["lowest"] == pytest.approx(0.1) and zero0[pairing]["highest"] == pytest.approx(0.1)
    assert len(s["files"]) == 8 and s["files"][0] == "gpu0/slot0/benchmark.json"


def test_a_slot_that_left_no_file_shifts_no_later_row_into_another_round(tmp_path, monkeypatch):
    # As above, but GPU 0's slot 1 fit was killed before it wrote anything: its round-2 rows stay in round 2
    (tmp_path / "engines.txt").write_text("ddp zero0\n")
    for g, order in ((0, ["ddp", None, "zero0", "ddp"]), (1, ["zero0", "ddp", "ddp", "zero0"])):
        for t, name in enumerate(order):
            if name:
                ms = {"ddp": 10.0, "zero0": 11.0}[name] * (2 if t >= 2 else 1)
                _write(tmp_path, f"gpu{g}/slot{t}", [_row(name, ms, started=1000.0 + 100 * t)])
    _main(monkeypatch, tmp_path)
    s = json.loads((tmp_path / "tax_square.json").read_text())
    assert [r["round"] for r in s["rows"] if r["gpu"] == 0] == [1, 2, 2]
    same_gpu = _engine(s, "zero0")["tax_same_gpu"]
    assert same_gpu["n"] == 3 and same_gpu["highest"] == pytest.approx(0.1)  # no round-2 row against round 1's 10 ms


def test_rows_whose_timed_steps_barely_overlap_are_no_pair(tmp_path, monkeypatch):
    # ddp timed 9.0-10.0 s; zero0 timed 9.8-11.8 s: 0.2 s in common, 20% of the shorter window
    _write(tmp_path, "gpu0", [_row("ddp", 10.0, rnd=1)])
    _write(tmp_path, "gpu1", [_row("zero0", 20.0, wall_s=11.8, rnd=1)])
    _main(monkeypatch, tmp_path)
    s = json.loads((tmp_path / "tax_square.json").read_text())
    assert _engine(s, "zero0")["tax_same_time"] is None
    assert next(r for r in s["rows"] if r["strategy"] == "zero0")["overlap"] == pytest.approx(0.2)


def test_a_folder_with_two_runs_layouts_is_refused(tmp_path, monkeypatch):
    _write(tmp_path, "gpu0", [_row("ddp", 10.0, rnd=1)])
    _write(tmp_path, "gpu0/slot0", [_row("ddp", 10.0, started=1.0)])
    with pytest.raises(SystemExit, match="two runs"):
        _main(monkeypatch, tmp_path)


def test_the_square_with_no_finished_row_says_so(tmp_path, monkeypatch):
    _write(tmp_path, "gpu0", [_row("ddp", 10.0, status="failed")])
    with pytest.raises(SystemExit, match="no ok rows"):
        _main(monkeypatch, tmp_path)


def test_several_squares_pool_their_pairs_each_formed_within_its_own_square(tmp_path, monkeypatch):
    # Square A: zero0 +8% against ddp; square B, a slower machine an hour later: zero0 +20%. In both, GPU 1 runs
    # everything 1.5x slower, so the two kinds of pair differ: on one GPU the tax alone, at the same time that and
    # the GPUs' difference. Had rows been paired across squares, B's rows would meet A's at twice their times.
    for name, base, tax, start in (("a", 10.0, 1.08, 1000.0), ("b", 20.0, 1.2, 4600.0)):
        for g, order in ((0, ["ddp", "zero0"]), (1, ["zero0", "ddp"])):
            for t, engine in enumerate(order):
                ms = base * (tax if engine == "zero0" else 1.0) * (1.5 if g == 1 else 1.0)
                _write(tmp_path / name, f"gpu{g}/slot{t}", [_row(engine, ms, started=start + 100 * t)])
    out = tmp_path / "pooled"
    monkeypatch.setattr(sys, "argv", ["tax_square.py", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    tax_square.main()
    pooled = json.loads((out / "tax_pooled.json").read_text())
    zero0 = _engine(pooled, "zero0")
    assert sorted(zero0["taxes_same_gpu"]) == pytest.approx([0.08, 0.08, 0.2, 0.2])
    assert sorted(zero0["taxes_same_time"]) == pytest.approx([1.08 / 1.5 - 1, 1.2 / 1.5 - 1, 1.5 * 1.08 - 1, 1.5 * 1.2 - 1])
    assert zero0["tax_same_gpu"]["median"] == pytest.approx(0.14) and zero0["tax_same_gpu"]["within_10pct"] == 2
    assert (tmp_path / "a" / "tax_square.json").is_file() and (tmp_path / "b" / "tax_square.md").is_file()
    md = (out / "tax_pooled.md").read_text()
    assert "Pairs of 2 squares" in md
    assert ("| zero0 | +14.0% (+8.0% to +20.0%, n=4; within 5%: 0, within 10%: 2) | "
            "+21.0% (-28.0% to +80.0%, n=4; within 5%: 0, within 10%: 0) |") in md
    pytest.importorskip("matplotlib")
    assert (out / "tax_pooled.png").stat().st_size > 0


def test_pooling_keeps_the_first_squares_engine_order(tmp_path, monkeypatch):
    for name in ("a", "b"):
        for g, order in ((0, ["ddp", "zero2", "zero1"]), (1, ["zero1", "ddp", "zero2"])):
            for t, engine in enumerate(order):
                _write(tmp_path / name, f"gpu{g}/slot{t}", [_row(engine, 10.0, started=100.0 * t)])
    out = tmp_path / "pooled"
    monkeypatch.setattr(sys, "argv", ["tax_square.py", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    tax_square.main()
    first = [e["strategy"] for e in json.loads((tmp_path / "a" / "tax_square.json").read_text())["engines"]]
    pooled = [e["strategy"] for e in json.loads((out / "tax_pooled.json").read_text())["engines"]]
    assert pooled == [e for e in first if e != "ddp"]


@pytest.mark.parametrize("argv, says", [(["a", "b"], "--out: several squares"), (["a", "--out", "p"], "--out: pools"),
                                        (["a", "a", "--out", "p"], "named twice")])
def test_pooling_arguments_that_cannot_mean_what_they_say_are_refused(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tax_square.py", *argv])
    with pytest.raises(SystemExit):
        tax_square.main()
    assert says in capsys.readouterr().err
