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


def _write(folder, gpu, rows):
    (folder / f"gpu{gpu}").mkdir(parents=True)
    result = {"command": f"zerotrain benchmark imdb --gpu {gpu}", "rows": rows,
              "environment": {"gpus": ["GPU"], "versions": {"torch": "t", "deepspeed": "d"}, "commit": "abc"}}
    (folder / f"gpu{gpu}" / "benchmark.json").write_text(json.dumps(result))


def _row(strategy, ms, rnd=1, status="ok"):
    return {"strategy": strategy, "round": rnd, "status": status, "throughput_sec_per_step": ms / 1000,
            "throughput_host_cpu_frac": 0.5}


def test_the_square_pairs_rows_by_gpu_and_round_and_by_time_slot(tmp_path, monkeypatch):
    # GPU 0 ran ddp then zero0; GPU 1 zero0 then ddp. GPU 1 is 2x slower, the second slot 1.5x slower.
    _write(tmp_path, 0, [_row("ddp", 10.0), _row("zero0", 16.5)])  # zero0 +10% over its slot's factor
    _write(tmp_path, 1, [_row("zero0", 22.0), _row("ddp", 30.0), _row("zero1", 1.0, status="failed")])
    _main(monkeypatch, tmp_path)
    s = json.loads((tmp_path / "tax_square.json").read_text())
    zero0 = next(e for e in s["engines"] if e["strategy"] == "zero0")
    # same GPU and round: 16.5/10 - 1 and 22/30 - 1, the second slot's slowdown still in them
    assert zero0["tax_same_gpu"]["n"] == 2
    assert zero0["tax_same_gpu"]["lowest"] == pytest.approx(22 / 30 - 1)
    assert zero0["tax_same_gpu"]["highest"] == pytest.approx(0.65)
    # same slot: 22/10 - 1 (slot 0), 16.5/30 - 1 (slot 1); the failed row is left out
    assert sorted(zero0["tax_same_slot"][k] for k in ("lowest", "highest")) == pytest.approx([16.5 / 30 - 1, 1.2])
    assert [e["strategy"] for e in s["engines"]] == ["ddp", "zero0"]
    assert s["median_ms_per_gpu"] == {"0": pytest.approx(13.25), "1": pytest.approx(26.0)}
    md = (tmp_path / "tax_square.md").read_text()
    assert "commit abc" in md and "zerotrain benchmark imdb --gpu 1" in md
    assert "| zero0 | 2 | 19.25 |" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tax_square.png").stat().st_size > 0


def test_the_square_with_no_finished_row_says_so(tmp_path, monkeypatch):
    _write(tmp_path, 0, [_row("ddp", 10.0, status="failed")])
    with pytest.raises(SystemExit, match="no ok rows"):
        _main(monkeypatch, tmp_path)
