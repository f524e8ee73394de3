"""benchmarks/zero_step_host.py: the ZeRO-1 step's host time, with zerotrain's methods and without, in one process."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_python


@pytest.mark.slow
def test_it_times_each_variant_with_its_methods_removed_and_writes_its_files(tmp_path):
    """On a CPU (a check that it runs, not a measurement): every variant timed in every block, the methods each
    removed named, the JSON, Markdown and PNG written."""
    out = run_python([str(REPO / "benchmarks" / "zero_step_host.py"), str(tmp_path / "r"), "--steps", "2",
                      "--blocks", "2", "--warmup", "1", "--micro_batch", "2", "--seq", "16"], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    result = json.loads((tmp_path / "r" / "zero_step_host.json").read_text())
    assert result["parameter_tensors"] == 79 and result["stage"] == 1
    rows = result["rows"]
    assert list(rows) == ["zerotrain", "without one-group norm", "deepspeed"]
    assert rows["zerotrain"]["removed"] == [] and rows["without one-group norm"]["removed"] == ["scaled_global_norm"]
    assert rows["zerotrain"]["deepspeeds_methods"] == []
    assert rows["without one-group norm"]["deepspeeds_methods"] == ["scaled_global_norm"]
    # ZeRO-1 on one rank: the norm, the clip, the rebinding and the skipped reduction were all zerotrain's
    assert sorted(rows["deepspeed"]["deepspeeds_methods"]) == sorted(rows["deepspeed"]["removed"])
    for row in rows.values():
        assert len(row["block_medians_ms"]) == 2 and row["median_ms"] > 0
    assert "| without one-group norm | scaled_global_norm |" in (tmp_path / "r" / "zero_step_host.md").read_text()
    assert (tmp_path / "r" / "zero_step_host.png").stat().st_size > 0
