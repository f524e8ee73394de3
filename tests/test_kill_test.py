"""The kill test (benchmarks/kill_test.py) in small: kill -9 twice, resume, and compare with an uninterrupted run."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, run_python


@pytest.mark.slow
def test_kill_minus_nine_and_resume_loses_and_damages_nothing(tmp_path):
    out = tmp_path / "kill_test.json"
    proc = run_python([str(REPO / "benchmarks" / "kill_test.py"), "--kills", "2", "--configs", "zero0",
                       "--out", str(out), "--seed", "1"], REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    total = json.loads(out.read_text())["total"]
    assert total["kills"] == 2
    assert total["resumes_ok"] == total["resumes"] == 2  # the restart after the first kill, and the one that finished
    assert total["corrupt_checkpoints"] == 0
    assert total["bitwise_equal"] is True
