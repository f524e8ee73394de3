"""benchmarks/engine_host.py: each engine's host time of one IMDB (b) step, built and timed in one process."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO, make_tokenizer, run_python

SCRIPT = str(REPO / "benchmarks" / "engine_host.py")
sys.path.insert(0, str(REPO / "benchmarks"))  # as when run as a script: its folder's modules (blocks) importable
_spec = importlib.util.spec_from_file_location("engine_host", SCRIPT)
engine_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_host)


@pytest.mark.slow
def test_it_times_every_engine_in_turn_and_writes_its_files(tmp_path):
    """On a CPU (a check that it runs, not a measurement): every variant timed in every block, the ZeRO-0 engine
    once with its forward and backward direct and once through DeepSpeed's, the JSON, Markdown and PNG written."""
    make_tokenizer(tmp_path / "tok")
    out = run_python([SCRIPT, str(tmp_path / "r"), "--steps", "2", "--blocks", "2", "--warmup", "1",
                      "--micro_batch", "2", "--seq", "16", "--", "--data.tokenizer", str(tmp_path / "tok"),
                      "--model.embed_dim", "16", "--model.hidden_dim", "32", "--model.num_heads", "2",
                      "--model.max_len", "64", "--compile.enabled", "false", "--trainer.device", "cpu"], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    result = json.loads((tmp_path / "r" / "engine_host.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["plain", "zero0", "zero0 via deepspeed", "zero1", "zero2"]
    assert [rows[v]["direct_forward_backward"] for v in rows] == [None, True, False, None, None]
    for row in rows.values():
        assert len(row["block_host_medians_ms"]) == 2 and row["host_median_ms"] > 0
    table = (tmp_path / "r" / "engine_host.md").read_text()
    assert "| zero0 via deepspeed |" in table and "zero0 against zero0 via deepspeed, block by block" in table
    assert (tmp_path / "r" / "engine_host.png").stat().st_size > 0


def test_an_unknown_variant_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [SCRIPT, str(tmp_path / "r"), "--variants", "plain,zero9"])
    with pytest.raises(SystemExit) as stop:
        engine_host.main()
    assert stop.value.code == 2 and "--variants: unknown ['zero9']" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [SCRIPT, str(tmp_path / "r"), "--variants", "plain,zero0,plain"])
    with pytest.raises(SystemExit):
        engine_host.main()
    assert "--variants: a variant named twice" in capsys.readouterr().err


def _run(folder, commit: str, blocks: dict[str, list[float]], seq: int = 320) -> None:
    folder.mkdir(parents=True)
    rows = {name: {"block_host_medians_ms": b} for name, b in blocks.items()}
    (folder / "engine_host.json").write_text(json.dumps({"commit": commit, "gpu": "G", "seq": seq, "rows": rows}))


def test_pooling_pairs_each_block_with_the_plain_block_of_its_run(tmp_path, monkeypatch):
    """Two runs whose plain blocks differ by 2 ms: pairing within each run gives zero0 +0.1 ms in every block,
    which pooling all blocks before pairing would not."""
    _run(tmp_path / "a", "c1", {"plain": [5.0, 5.0], "zero0": [5.1, 5.1], "zero0 via deepspeed": [5.5, 4.9]})
    _run(tmp_path / "b", "c1", {"plain": [7.0, 7.0], "zero0": [7.1, 7.1], "zero0 via deepspeed": [7.5, 7.5]})
    engine_host.pool(tmp_path / "p", [tmp_path / "a", tmp_path / "b"])
    pooled = json.loads((tmp_path / "p" / "engine_host_pooled.json").read_text())
    zero0 = pooled["rows"]["zero0"]
    assert zero0["blocks"] == 4 and zero0["paired_difference_ms"] == pytest.approx(0.1) and zero0["blocks_lower"] == 0
    assert pooled["rows"]["zero0 via deepspeed"]["paired_difference_ms"] == pytest.approx(0.5)
    assert pooled["zero0_against_deepspeeds_forward_backward"] == {
        "blocks": 4, "median_difference_ms": pytest.approx(-0.4), "blocks_lower": 3}
    assert "| zero0 | 4 |" in (tmp_path / "p" / "engine_host_pooled.md").read_text()
    _run(tmp_path / "c", "c1", {"zero0": [5.0]})
    with pytest.raises(SystemExit, match="ran no plain variant"):
        engine_host.pool(tmp_path / "p", [tmp_path / "a", tmp_path / "c"])
    _run(tmp_path / "d", "c1", {"plain": [5.0], "zero0": [5.0]}, seq=64)
    with pytest.raises(SystemExit, match="the runs differ in seq"):
        engine_host.pool(tmp_path / "p", [tmp_path / "a", tmp_path / "d"])
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--pool", str(tmp_path / "q")])
    with pytest.raises(SystemExit, match="give OUT_DIR and at least one run folder"):
        engine_host.main()
