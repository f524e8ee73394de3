"""Tracker: what reaches metrics.jsonl, also when values are not finite or the file was cut short."""

from __future__ import annotations

import errno
import json

import pytest
from helpers import file_size_limit

from zerotrain.config import LoggingConfig
from zerotrain.errors import UserError
from zerotrain.metrics.tracking import EventFile, Tracker


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


def test_a_full_disk_while_logging_is_one_line_and_leaves_whole_lines(tmp_path):
    t = tracker(tmp_path)
    t.log(1, {"train_loss": 1.0})
    size = (tmp_path / "metrics.jsonl").stat().st_size
    with file_size_limit(size + 20):  # room for part of the next line, not all of it
        with pytest.raises(UserError, match=r"^no space left to write metrics.jsonl in .* free\)") as err:
            t.log(2, {"train_loss": 0.5, "lr": 0.1, "grad_norm": 2.0})
        t.close()  # nothing is left in a buffer: closing cannot fail a second time
    assert "\n" not in str(err.value)
    assert rows(tmp_path) == [{"step": 1, "train_loss": 1.0}]  # no half line


def test_tensorboard_events_are_written_whole_or_not_at_all(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventFile(tmp_path)
    events.scalars({"train_loss": 1.0, "lr": 0.1}, step=1)
    (path,) = tmp_path.iterdir()
    size = path.stat().st_size
    with file_size_limit(size + 30):  # one record fits, not the step's two
        with pytest.raises(OSError) as err:
            events.scalars({"train_loss": 0.5, "lr": 0.1}, step=2)
    events.close()
    assert err.value.errno == errno.EFBIG and path.stat().st_size == size
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("train_loss")] == [(1, 1.0)]


def test_a_resume_removes_the_points_logged_after_its_checkpoint_from_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import (
        RawEventFileLoader,
    )
    from tensorboard.compat.proto.event_pb2 import Event

    first = Tracker(tmp_path, LoggingConfig(progress_bar=False), {}, True)
    for step in (1, 2, 3, 4):
        first.log(step, {"train_loss": float(step)})
    first.close()  # a run killed at step 4, its checkpoint at step 2
    again = Tracker(tmp_path, LoggingConfig(progress_bar=False), {}, True, resumed_at=2)
    for step in (3, 4):
        again.log(step, {"train_loss": 10.0 * step})
    again.close()
    accumulator = EventAccumulator(str(tmp_path / "tb_dir"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("train_loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    events = [Event.FromString(raw) for path in sorted((tmp_path / "tb_dir").iterdir())
              for raw in RawEventFileLoader(str(path)).Load()]
    written = [(e.step, e.summary.value[0].simple_value) for e in events if e.HasField("summary")]
    assert written == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]  # in the files themselves, not only as shown
