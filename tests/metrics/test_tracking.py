"""Tracker: what reaches metrics.jsonl, also when values are not finite or the file was cut short."""

from __future__ import annotations

import json

import pytest

from zerotrain.config import LoggingConfig
from zerotrain.errors import UserError
from zerotrain.metrics.tracking import Tracker


def tracker(tmp_path, resumed_at=None) -> Tracker:
    return Tracker(tmp_path, LoggingConfig(tensorboard=False, progress_bar=False), {}, True, resumed_at=resumed_at)


def rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_non_finite_values_are_logged_by_name_not_dropped(tmp_path):
    t = tracker(tmp_path)
    t.log(1, {"train_loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1, "skipped": None})
    t.log(2, {"train_loss": float("-inf")})
    t.close()
    assert rows(tmp_path) == [{"step": 1, "train_loss": "nan", "grad_norm": "inf", "lr": 0.1},
                              {"step": 2, "train_loss": "-inf"}]


def test_a_half_written_last_line_is_repaired_on_resume(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 1.0}\n{"step": 2, "train_loss": 0.5}\n{"step": 3, "tr')
    with caplog.at_level("WARNING", logger="zerotrain"):
        t = tracker(tmp_path, resumed_at=2)
    t.log(3, {"train_loss": 0.25})
    t.close()
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]
    assert "not JSON" in caplog.text


def test_a_fresh_start_clears_what_an_earlier_attempt_logged(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 1.0}\n')
    (tmp_path / "tb_dir").mkdir()
    (tmp_path / "tb_dir" / "events.out.tfevents.1").write_bytes(b"old")
    t = tracker(tmp_path)
    t.log(1, {"train_loss": 2.0})
    t.close()
    assert rows(tmp_path) == [{"step": 1, "train_loss": 2.0}]
    assert not (tmp_path / "tb_dir").exists()


def test_a_full_disk_while_logging_is_one_line(tmp_path):
    import errno

    t = tracker(tmp_path)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self): ...

    t._jsonl = Full()
    with pytest.raises(UserError, match=r"no space left to write metrics.jsonl in .* free\)"):
        t.log(1, {"train_loss": 1.0})
