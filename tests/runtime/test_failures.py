"""Failures during training end in one line and a documented exit status.

* A dead (kill -9) or hung (SIGSTOP) rank: the job ends within ``--launch.timeout_minutes`` (plus the
  start-up) with one line from the launcher naming the rank, its last step and the last complete
  checkpoint; status 137 (128 + SIGKILL) or ``RANK_LOST_EXIT`` (4).
* A loss that stays NaN/inf, or fp16's loss scale stuck at its minimum: one line with the step, the last
  good checkpoint and what to try; status ``DIVERGED_EXIT`` (3).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import start_zerotrain, zerotrain_cmd

from zerotrain.checkpoint.layout import is_complete
from zerotrain.config import LaunchConfig
from zerotrain.errors import DIVERGED_EXIT, RANK_LOST_EXIT, ConfigError, TrainingDiverged
from zerotrain.runtime.launcher import (
    PROGRESS_ENV,
    Progress,
    collective_failure,
    describe_failure,
    read_progress,
)
from zerotrain.metrics.tracking import DIVERGED_WINDOWS, StepLogger

# ---- --launch.timeout_minutes takes fractions ----------------------------------------------------


def test_timeout_minutes_accepts_fractions_down_to_three_seconds():
    LaunchConfig(timeout_minutes=0.2).validate()
    LaunchConfig(timeout_minutes=0.05).validate()
    for bad in (0.04, 0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match=r"^--launch.timeout_minutes must be >= 0.05 \(3 seconds\)"):
            LaunchConfig(timeout_minutes=bad).validate()


def test_a_fractional_timeout_reaches_the_groups_deepspeed_creates(monkeypatch):
    """DeepSpeed's ZeRO groups come from its backend's new_group(ranks), with no timeout: inside a fit's process
    group they get --launch.timeout_minutes (seconds, not minutes), and after it DeepSpeed's own method is back."""
    import datetime

    import deepspeed.comm as ds_comm
    import torch

    from zerotrain.runtime.distributed import setup
    from zerotrain.tasks.toy import ToyConfig

    cfg = ToyConfig()
    cfg.trainer.device = "cpu"
    cfg.launch.timeout_minutes = 0.2
    seen = []
    real = torch.distributed.new_group
    monkeypatch.setattr(torch.distributed, "new_group", lambda *args, **kwargs: seen.append(kwargs) or real(*args, **kwargs))
    with setup(cfg):
        backend = ds_comm.comm.cdb
        ds_comm.new_group([0])
        assert "new_group" in vars(backend)
    assert seen and seen[-1]["timeout"] == datetime.timedelta(seconds=12)
    assert "new_group" not in vars(backend)


# ---- which rank, which step: progress files and the launcher's report ----------------------------


def test_progress_records_step_and_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, str(tmp_path))
    beat = Progress(3, Path("/runs/toy.1"), step=0)
    for step in range(1, 1001):
        beat.beat(step)
    beat.close()
    assert read_progress(str(tmp_path)) == {3: {"step": 1000, "run_dir": "/runs/toy.1"}}


def test_without_a_launcher_progress_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    beat = Progress(0, tmp_path / "run", step=5)
    beat.beat(6)
    beat.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("message, timed_out", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 12000ms for recv operation "
     "to complete", True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:36744: Connection reset by peer",
     False),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5678", False),
    ("Application timeout caused pair closure", False),  # the other rank timed out: this one was stopped
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)", True),
])
def test_collective_failures_are_recognised(message, timed_out):
    assert collective_failure(RuntimeError(message)) is timed_out


def test_other_errors_are_not_collective_failures():
    assert collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert collective_failure(ValueError("Connection reset by peer")) is None  # not what torch.distributed raises


def _failure(exitcode: int, local_rank: int, timestamp: int = 100, message: dict | str = "", pid: int = 0):
    """What torchelastic's ProcessFailure holds: ``message`` is the worker's record (see launcher.ErrorFile)."""
    names = {-15: "SIGTERM", -9: "SIGKILL", -19: "SIGSTOP"}
    return SimpleNamespace(exitcode=exitcode, local_rank=local_rank, timestamp=timestamp, message=message, pid=pid,
                           signal_name=lambda: names[exitcode])


def _lost(timed_out: bool) -> dict:
    return {"message": "zerotrain fit: rank R: a collective ...", "errorCode": RANK_LOST_EXIT,
            "extraInfo": {"timestamp": "100", "timed_out": timed_out}}


_STOP_EVERYWHERE = '''
import os, sys
from pathlib import Path
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from zerotrain.errors import OutOfMemory, RankLost
from zerotrain.runtime.launcher import ErrorFile

writer, path = sys.argv[1], Path(sys.argv[2])
os.environ.update(TORCHELASTIC_ERROR_FILE=str(path))
error = (OutOfMemory("out of GPU memory at step 3 (rank 1)") if writer == "user error" else
         RankLost("rank 1: a collective lost its connection", timed_out=False))
handler = ErrorFile("toy")


def write():
    handler.record_exception(error)


write()  # imports done, so that the stops below fall in the write itself
path.unlink()
stops = 0
while True:
    events = 0

    def stop_at_the_next_new_event(frame, event, arg):
        global events
        events += 1
        if events == stops + 1:
            raise KeyboardInterrupt
        return stop_at_the_next_new_event

    sys.settrace(stop_at_the_next_new_event)
    try:
        write()
        break  # ran to its end: every event before the last has been a stop
    except KeyboardInterrupt:
        stops += 1
    finally:
        sys.settrace(None)
    if path.exists():
        ProcessFailure(local_rank=1, pid=1, exitcode=5, error_file=str(path))  # raises if cut short
        path.unlink()
    for leftover in path.parent.glob(".*.tmp"):  # a stop inside the clean-up of the temporary file
        leftover.unlink()
failure = ProcessFailure(local_rank=1, pid=1, exitcode=error.exit_status, error_file=str(path))
assert failure.message["message"].startswith("zerotrain toy") and failure.message["errorCode"] == error.exit_status
assert [p.name for p in path.parent.iterdir()] == ["error.json"]
print("stops", stops)
'''


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["user error", "rank lost"])
def test_a_worker_stopped_anywhere_in_writing_its_error_file_leaves_none_or_a_whole_one(tmp_path, writer):
    """Once a worker fails, torchelastic stops the others and parses each failed worker's error file: a file cut
    short by the stop would fail that parse (CI once saw an empty one end a job as "could not start the worker
    processes"). The write is stopped at each of its Python events in turn (an exception raised by a trace
    hook stands for the signal); after every stop the file is absent or parses. In a process of its own: an
    exception raised from a trace hook can leave the interpreter's handled-exception state behind."""
    from helpers import run_python

    script = tmp_path / "stop_everywhere.py"
    script.write_text(_STOP_EVERYWHERE)
    path = tmp_path / "attempt_0" / "1" / "error.json"
    path.parent.mkdir(parents=True)
    out = run_python([str(script), writer, str(path)], tmp_path, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert int(out.stdout.split("stops")[-1]) > 10


def test_torchelastic_reads_a_workers_record_as_its_failure(tmp_path, monkeypatch):
    """The record a worker leaves through torchelastic's ``record`` is what ProcessFailure hands the launcher."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure, record

    from zerotrain.errors import OutOfMemory
    from zerotrain.runtime.launcher import ErrorFile

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def run():
        raise OutOfMemory("out of GPU memory at step 3 (rank 1)")

    with pytest.raises(OutOfMemory):
        record(run, error_handler=ErrorFile("fit"))()
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=5, error_file=str(path))
    assert describe_failure({1: failure, 0: _failure(-15, 0)}) == (
        "zerotrain fit: error: out of GPU memory at step 3 (rank 1)", 5)


@pytest.fixture
def run_with_checkpoints(tmp_path) -> Path:
    """A run folder with complete checkpoints at steps 5 and 10 and an incomplete one at 15."""
    run = tmp_path / "toy.run1"
    for step, complete in ((5, True), (10, True), (15, False)):
        folder = run / "checkpoints" / f"step{step:08d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "COMPLETE.json").write_text("{}")
    return run


def test_a_stopped_rank_is_named_with_its_step_and_the_last_checkpoint(run_with_checkpoints):
    """Rank 0 timed out waiting; rank 1 was found stopped, then continued and lost its connection."""
    run = run_with_checkpoints
    progress = {0: {"step": 12, "run_dir": str(run)}, 1: {"step": 12, "run_dir": str(run)}}
    failures = {0: _failure(RANK_LOST_EXIT, 0, 100, _lost(True), pid=100),
                1: _failure(RANK_LOST_EXIT, 1, 101, _lost(False), pid=101)}
    assert describe_failure(failures, progress, 0.2, {101}) == (
        "zerotrain: rank 1 stopped responding after step 12; the job stopped after --launch.timeout_minutes 0.2. "
        f"Last complete checkpoint: {run}/checkpoints/step00000010 (resume with --checkpoint.resume auto "
        "--trainer.run_name toy.run1)", RANK_LOST_EXIT)


def test_a_stopped_rank_that_left_on_torchelastics_sigterm_outside_the_loop_is_still_the_one_named():
    """Rank 0 was stopped outside the training loop (SIGTERM there exits 128 + 15, no record); rank 1 timed out."""
    failures = {0: _failure(128 + signal.SIGTERM, 0, 101, pid=100), 1: _failure(RANK_LOST_EXIT, 1, 100, _lost(True))}
    line, code = describe_failure(failures, {r: {"step": 7, "run_dir": None} for r in (0, 1)}, 0.2, {100})
    assert code == RANK_LOST_EXIT
    assert line.startswith("zerotrain: rank 0 stopped responding after step 7; the job stopped after "
                           "--launch.timeout_minutes 0.2. No checkpoint")


def test_a_hung_rank_that_said_nothing_is_named_before_one_that_lost_its_connection():
    """Four ranks: 0 and 2 timed out, 3 lost its connection when they left, 1 never answered (killed at the end)."""
    progress = {r: {"step": 7, "run_dir": None} for r in range(4)}
    failures = {0: _failure(RANK_LOST_EXIT, 0, 100, _lost(True)), 2: _failure(RANK_LOST_EXIT, 2, 100, _lost(True)),
                3: _failure(RANK_LOST_EXIT, 3, 101, _lost(False)), 1: _failure(-9, 1, 131)}
    line, code = describe_failure(failures, progress, 1.0)
    assert code == RANK_LOST_EXIT
    assert line.startswith("zerotrain: rank 1 stopped responding after step 7; the job stopped after "
                           "--launch.timeout_minutes 1. No checkpoint")


def test_a_killed_rank_is_named_with_its_step(run_with_checkpoints):
    run = run_with_checkpoints
    progress = {0: {"step": 31, "run_dir": str(run)}, 1: {"step": 30, "run_dir": str(run)}}
    failures = {1: _failure(-9, 1, 100), 0: _failure(RANK_LOST_EXIT, 0, 100, _lost(False))}
    assert describe_failure(failures, progress, 0.2) == (
        "zerotrain: rank 1 (local rank 1) was killed by SIGKILL after step 30 (out of memory?); the job stopped. "
        f"Last complete checkpoint: {run}/checkpoints/step00000010 (resume with --checkpoint.resume auto "
        "--trainer.run_name toy.run1)", 137)


def test_a_rank_lost_on_another_node_is_said_from_this_one():
    failures = {2: _failure(RANK_LOST_EXIT, 0, 100, _lost(True)), 3: _failure(RANK_LOST_EXIT, 1, 100, _lost(True))}
    progress = {2: {"step": 4, "run_dir": None}, 3: {"step": 4, "run_dir": None}}
    line, code = describe_failure(failures, progress, 5.0)
    assert code == RANK_LOST_EXIT
    assert line.startswith("zerotrain: a rank on another node stopped responding (rank 2 waited for it after step 4; "
                           "see that node's output)")


def test_a_diverged_run_is_said_once_from_the_lowest_ranks_record():
    record = {"message": "zerotrain fit: error: training diverged at step 9", "errorCode": DIVERGED_EXIT,
              "extraInfo": {"timestamp": "1"}}
    failures = {1: _failure(DIVERGED_EXIT, 1, message=record), 0: _failure(DIVERGED_EXIT, 0, message=record),
                2: _failure(-15, 2)}
    assert describe_failure(failures) == ("zerotrain fit: error: training diverged at step 9", DIVERGED_EXIT)


def test_a_rank_stopped_while_exiting_after_its_own_line_is_still_the_cause():
    """Rank 1 recorded a user error and closed its process group; rank 0's collective failed at once and it left
    first, so torchelastic stopped rank 1 (SIGTERM) before it had exited: its record is still the cause."""
    record = {"message": "zerotrain fit: error: data.jsonl: record 1000: label 'maybe' is not one of the 2 classes",
              "errorCode": 2, "extraInfo": {"timestamp": "1"}}
    failures = {0: _failure(RANK_LOST_EXIT, 0, 100, _lost(False)), 1: _failure(-15, 1, 101, message=record)}
    progress = {r: {"step": 20, "run_dir": None} for r in (0, 1)}
    assert describe_failure(failures, progress, 2.0) == (record["message"], 2)


# ---- a loss that diverged ------------------------------------------------------------------------


class _Engine:
    """What StepLogger reads from an engine, with the loss, loss scale and skipped steps set by the test."""

    world_size, device = 1, None

    def __init__(self, precision: str = "fp32", ds_config: dict | None = None):
        self.precision, self.ds_config = precision, ds_config
        self.scale, self.skipped, self.reads = None, 0, 0

    def all_reduce_sum(self, values):
        self.reads += 1
        return {k: float(v) for k, v in values.items()}

    def lr(self): return 1e-3
    def grad_norm(self): return 1.0
    def loss_scale(self): return self.scale
    def skipped_steps(self): return self.skipped


class _Tracker:
    def __init__(self, run_dir: Path):
        self.run_dir, self.rows, self.closed = run_dir, [], False

    def log(self, step, row): self.rows.append((step, row["train_loss"]))
    def close(self): self.closed = True


class _State:
    def __init__(self):
        self.step, self.epoch, self.window_loss, self.window_steps = 0, 0, 0.0, 0

    def advance(self, loss):
        self.step += 1
        self.window_loss += loss
        self.window_steps += 1

    def close_window(self):
        self.window_loss, self.window_steps = 0.0, 0


def _logger(tmp_path, engine, every=1):
    meter = SimpleNamespace(read=lambda: {})
    bar = SimpleNamespace(set_postfix=lambda **kw: None)
    return StepLogger(every, 1000, engine, meter, _Tracker(tmp_path), bar)


def _train(logger: StepLogger, losses: list[float], state: _State | None = None):
    state = state or _State()
    for loss in losses:
        state.advance(loss)
        if logger.should_log(state.step):
            logger.log(state)
    return state


def test_a_single_nonfinite_window_is_a_transient(tmp_path, monkeypatch):
    monkeypatch.setattr("zerotrain.metrics.tracking.memory_snapshot", lambda device: {})
    logger = _logger(tmp_path, _Engine())
    _train(logger, [1.0, float("nan"), 0.9, float("inf"), 0.8])
    assert [round(loss, 1) if loss == loss else "nan" for _, loss in logger.tracker.rows][:3] == [1.0, "nan", 0.9]
    assert not logger.tracker.closed


def test_a_loss_nonfinite_in_consecutive_windows_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr("zerotrain.metrics.tracking.memory_snapshot", lambda device: {})
    from zerotrain.checkpoint.layout import seal

    for step in (4, 8, 12):  # 12 was saved after the loss went bad: not a good checkpoint
        folder = tmp_path / "checkpoints" / f"step{step:08d}"
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"weights")
        (folder / "COMPLETE.json").write_text(json.dumps({"files": seal(folder, 0, 1, checksums=True)}))
    engine = _Engine()
    logger = _logger(tmp_path, engine, every=4)
    with pytest.raises(TrainingDiverged) as caught:
        _train(logger, [1.0] * 8 + [1.0, float("nan"), 1.0, 1.0] + [float("inf")] * 4)
    assert DIVERGED_WINDOWS == 2 and caught.value.step == 16
    good = tmp_path / "checkpoints" / "step00000008"
    assert str(caught.value) == (
        "training diverged at step 16: the training loss is inf at step 16 and has not been finite since step 8; "
        f"last good checkpoint: {good} (resume from it with --checkpoint.resume {good}). Try a lower "
        "--optimizer.lr, gradient clipping (--strategy.gradient_clipping 1.0), or a longer warm-up "
        "(--scheduler.warmup_steps)")
    assert logger.tracker.closed  # metrics.jsonl keeps the windows that showed it
    assert engine.reads == 4  # the loss was read on the 4 log steps only


def test_fp16_loss_scale_stuck_at_its_minimum_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("zerotrain.metrics.tracking.memory_snapshot", lambda device: {})
    engine = _Engine("fp16", {"fp16": {"enabled": True, "min_loss_scale": 1.0}, "gradient_clipping": 1.0})
    logger = _logger(tmp_path, engine, every=2)
    state = _State()
    engine.scale = 1.0  # at the minimum, but no step skipped: a run that trains at scale 1 is fine
    _train(logger, [1.0] * 6, state)
    with pytest.raises(TrainingDiverged) as caught:
        for _ in range(3):  # every step skipped from here on, at the minimum scale
            engine.skipped += 2
            _train(logger, [1.0, 1.0], state)
    assert caught.value.step == 10
    assert str(caught.value).startswith(
        "training diverged at step 10: the fp16 loss scale is stuck at its minimum (1, --precision.min_loss_scale) and "
        "steps are still skipped for overflow (4 so far): nothing has trained since step 6; no checkpoint was saved "
        "while it was finite (--checkpoint.every_steps N saves one every N steps). Try bf16 instead of fp16")


FIT = ["fit", "toy", "--trainer.device", "cpu", "--trainer.num_workers", "0", "--logging.progress_bar", "false",
       "--logging.tensorboard", "false"]


def test_a_learning_rate_far_too_large_stops_with_one_line_and_status_3(tmp_path, capsys):
    """In-process, as the CLI runs it: the loss is finite at step 1 (the first weights), then inf/NaN."""
    from zerotrain.cli import main

    code = main([*FIT, "--trainer.max_steps", "50", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "r",
                 "--optimizer.lr", "1e6", "--trainer.log_every_steps", "1", "--checkpoint.every_steps", "1",
                 "--checkpoint.keep_last", "100"])
    err = capsys.readouterr().err
    assert code == DIVERGED_EXIT
    lines = [line for line in err.splitlines() if line.startswith("zerotrain")]
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"zerotrain fit: error: training diverged at step (?P<step>\d+): the training loss is (nan|inf) "
                     r"at step (?P=step) and has not been finite since step (?P<good>\d+); last good checkpoint: "
                     r"(?P<ckpt>\S+) \(resume from it with --checkpoint.resume (?P=ckpt)\)\. Try a lower "
                     r"--optimizer.lr, or a longer warm-up \(--scheduler.warmup_steps\)", lines[0])
    assert m, lines[0]
    # Checkpoints every step: the good one is that of the last finite loss, two windows before the stop.
    assert int(m["step"]) == int(m["good"]) + DIVERGED_WINDOWS
    assert Path(m["ckpt"]) == tmp_path / "r" / "checkpoints" / f"step{int(m['good']):08d}"
    assert is_complete(Path(m["ckpt"]))
    assert "Traceback" not in err
    assert not (tmp_path / "r" / "model").exists()  # no export of diverged weights


# ---- end to end: two workers on CPU (Gloo) -------------------------------------------------------

TWO = [*FIT, "--launch.nproc_per_node", "2", "--strategy.zero_stage", "2", "--checkpoint.every_steps", "5",
       "--trainer.log_every_steps", "5"]


def _job_lines(stderr: str) -> list[str]:
    """The launcher's and the CLI's lines (the log lines start with "[zerotrain]" instead)."""
    return [line for line in stderr.splitlines() if line.startswith("zerotrain")]


@pytest.mark.slow
def test_two_workers_whose_loss_diverges_stop_with_rank0s_line_only(tmp_path):
    proc = zerotrain_cmd([*TWO, "--trainer.max_steps", "200", "--trainer.output_dir", str(tmp_path),
                          "--optimizer.lr", "1e20", "--trainer.log_every_steps", "1"], cwd=tmp_path, timeout=300)
    assert proc.returncode == DIVERGED_EXIT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = _job_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("zerotrain fit: error: training diverged at step ")


def _start_and_wait_for_step(tmp_path: Path, step: int, timeout_minutes: str):
    """Start two workers for a long run; return the launcher and rank -> worker pid once both passed ``step``."""
    import psutil

    folder = tmp_path / "progress"
    proc = start_zerotrain([*TWO, "--trainer.max_steps", "100000", "--trainer.output_dir", str(tmp_path / "runs"),
                            "--trainer.run_name", "job", "--launch.timeout_minutes", timeout_minutes], tmp_path,
                           **{PROGRESS_ENV: str(folder)})
    deadline = time.monotonic() + 240  # start-up on 2 shared cores: imports, DeepSpeed, the first steps
    while time.monotonic() < deadline:
        now = read_progress(str(folder))
        if len(now) == 2 and min(b["step"] for b in now.values()) >= step:
            workers = {int(p.environ()["RANK"]): p.pid for p in psutil.Process(proc.pid).children()}
            return proc, workers
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the job did not reach step %d: %s" % (step, (tmp_path / "stderr.txt").read_text()[-3000:]))


def _finish(proc, tmp_path: Path, timeout: int) -> str:
    try:
        proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        raise
    return (tmp_path / "stderr.txt").read_text()


LINE = (r"Last complete checkpoint: (?P<ckpt>\S+/runs/job/checkpoints/step\d{8}) \(resume with --checkpoint.resume auto "
        r"--trainer.run_name job\)")


@pytest.mark.slow
def test_a_worker_killed_mid_training_ends_the_job_with_one_line(tmp_path):
    proc, workers = _start_and_wait_for_step(tmp_path, 12, "0.2")
    os.kill(workers[1], signal.SIGKILL)
    err = _finish(proc, tmp_path, timeout=60)  # a death is seen at once: no collective timeout to wait for
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "Traceback" not in err
    lines = _job_lines(err)
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"zerotrain: rank 1 \(local rank 1\) was killed by SIGKILL after step (?P<step>\d+) \(out of "
                     r"memory\?\); the job stopped\. " + LINE, lines[0])
    assert m, lines[0]
    assert int(m["step"]) >= 12
    assert is_complete(Path(m["ckpt"]))


@pytest.mark.slow
def test_a_stopped_worker_ends_the_job_after_the_timeout_with_one_line(tmp_path):
    """SIGSTOP of rank 0: rank 1 waits in a collective (ZeRO-2: of DeepSpeed's own group) for 0.2 min (12 s),
    then stops; torchelastic's SIGTERM to the stopped rank (continued at once) promises no save it cannot make.

    The subprocess timeout below is what asserts that the job does not hang: 12 s, the stopped worker's
    stop signal and the teardown fit in 90 s; Gloo's default timeout for DeepSpeed's groups (30 min) does not.
    """
    proc, workers = _start_and_wait_for_step(tmp_path, 12, "0.2")
    os.kill(workers[0], signal.SIGSTOP)
    err = _finish(proc, tmp_path, timeout=90)
    assert proc.returncode == RANK_LOST_EXIT, err[-3000:]
    assert "Traceback" not in err
    assert "saving a checkpoint" not in err, err[-3000:]
    lines = _job_lines(err)
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"zerotrain: rank 0 stopped responding after step (?P<step>\d+); the job stopped after "
                     r"--launch.timeout_minutes 0.2\. " + LINE, lines[0])
    assert m, lines[0]
    assert int(m["step"]) >= 12
    assert is_complete(Path(m["ckpt"]))


@pytest.mark.slow
def test_the_progress_folder_of_a_killed_launcher_is_removed_by_its_workers(tmp_path):
    """SIGKILL of the launcher: the workers it leaves finish, and the last to exit removes its progress folder
    (the launcher removes it itself on any other way out)."""
    import psutil

    proc = start_zerotrain([*TWO, "--trainer.max_steps", "25", "--trainer.log_every_steps", "1",
                            "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "job"], tmp_path)
    workers: list = []
    try:
        metrics = tmp_path / "job" / "metrics.jsonl"
        deadline = time.monotonic() + 240  # start-up on 2 shared cores
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
            time.sleep(0.1)
        workers = psutil.Process(proc.pid).children()
        folders = {w.environ()[PROGRESS_ENV] for w in workers}
        assert len(workers) == 2 and len(folders) == 1
        (folder,) = folders
        assert os.path.isdir(folder)
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=240)  # they run to the last step without their launcher
        assert not alive, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        proc.kill()
        for worker in workers:
            try:
                worker.kill()
            except psutil.Error:
                pass
    assert not os.path.exists(folder), (tmp_path / "stderr.txt").read_text()[-3000:]


def test_progress_folders_whose_launcher_is_gone_are_removed(tmp_path):
    """What the next launcher does for a launcher killed with its workers: only the folders of pids gone."""
    import subprocess
    import sys

    from zerotrain.runtime.launcher import remove_stale_progress_dirs

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale = tmp_path / f"zerotrain-progress-{ended.pid}-abc"
    live = tmp_path / f"zerotrain-progress-{os.getpid()}-def"
    given = tmp_path / "zerotrain-progress-xyz"  # not a name a launcher makes: a folder someone gave
    for folder in (stale, live, given):
        folder.mkdir()
        (folder / "rank0").write_text("3\n")
    assert remove_stale_progress_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.is_dir() and given.is_dir()


def test_a_progress_folder_the_caller_names_starts_without_an_earlier_job_s_records(tmp_path, monkeypatch):
    """An earlier job's ending kept for its restarts (``final-rank1``) would otherwise be replayed by this job's
    restarted workers, and its progress files named in this job's failure line."""
    from zerotrain.runtime.launcher import _progress_dir, read_progress
    from zerotrain.runtime.restarts import PROGRESS_ENV, ended_for_good

    given = tmp_path / "progress"
    given.mkdir()
    (given / "final-rank1").write_text('{"status": 2, "message": "an earlier job"}\n')
    (given / "rank0").write_text("         7\n/elsewhere/run\n")
    (given / "notes.txt").write_text("the caller's own file")
    assert ended_for_good(str(given)) and read_progress(str(given))
    monkeypatch.setenv(PROGRESS_ENV, str(given))
    assert _progress_dir() == (str(given), False)
    assert not ended_for_good(str(given)) and read_progress(str(given)) == {}
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_nvme_offload_without_libaio_ends_in_one_line_from_one_process_or_two(tmp_path):
    """Where DeepSpeed's async I/O op cannot be built (no libaio, as on this project's CI and GPU machines),
    NVMe offload is refused before the data and the model, with the same single line from one rank or two,
    where DeepSpeed's own failure is a traceback from inside deepspeed.initialize."""
    from zerotrain.runtime.doctor import op_buildable

    if op_buildable("AsyncIOBuilder"):
        pytest.skip("DeepSpeed's async I/O op can be built here: NVMe offload is not refused")
    lines = set()
    for nproc in (1, 2):
        out = zerotrain_cmd(["fit", "toy", "--strategy.zero_stage", "3", "--strategy.offload_optimizer", "nvme",
                             "--strategy.nvme_path", str(tmp_path / "swap"), "--trainer.max_steps", "1",
                             "--trainer.num_workers", "0", "--trainer.output_dir", str(tmp_path / f"runs{nproc}"),
                             "--launch.nproc_per_node", str(nproc)], cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, out.stderr[-3000:]
        lines.add(errors[0])
    (line,) = lines
    assert line.startswith("zerotrain fit: error: --strategy.offload_optimizer nvme: DeepSpeed's async I/O op")
    assert "libaio" in line and "offload to cpu" in line
