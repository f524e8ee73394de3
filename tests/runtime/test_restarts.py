"""``--launch.max_restarts``: a lost worker restarts the job, which resumes where it saved; an ending a restart cannot
fix (a user error, divergence, out of memory, a pre-emption) ends the job as it would without restarts."""

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

from zerotrain.config import LaunchConfig
from zerotrain.errors import ConfigError, UserError
from zerotrain.runtime import restarts
from zerotrain.runtime.launcher import (
    PROGRESS_ENV,
    error_record,
    read_progress,
    restart_cause,
    torchrun_arguments,
)
from zerotrain.runtime.preemption import PREEMPTED_EXIT


def test_max_restarts_reaches_torchrun_and_is_refused_on_several_nodes():
    assert torchrun_arguments(LaunchConfig(nproc_per_node=2, max_restarts=3), ["fit", "toy"]).max_restarts == 3
    assert torchrun_arguments(LaunchConfig(nproc_per_node=2), ["fit", "toy"]).max_restarts == 0
    with pytest.raises(ConfigError, match=r"--launch.max_restarts restarts the workers of one node"):
        LaunchConfig(nnodes=2, max_restarts=1).validate()


@pytest.fixture
def worker_env(tmp_path, monkeypatch):
    """This process as rank R of attempt K of a job zerotrain's launcher started with 2 restarts allowed."""
    monkeypatch.setenv(PROGRESS_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")

    def be(rank: int, attempt: int) -> Path:
        error_file = tmp_path / f"attempt{attempt}-rank{rank}.json"
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        return error_file

    return be


def test_a_restarted_worker_ends_as_the_attempt_before_ended_for_good(worker_env, tmp_path):
    worker_env(rank=1, attempt=0)
    record = error_record("fit", UserError("--data.train_path: x.jsonl does not exist"))
    assert not restarts.ended_for_good(str(tmp_path))
    assert restarts.keep_final(2, record)
    assert restarts.ended_for_good(str(tmp_path))  # the launcher says no restart line for the attempts that follow
    # rank 0 of the next attempt has no record of its own: it replays the lowest rank's, with its status
    error_file = worker_env(rank=0, attempt=1)
    assert restarts.replay_final() == 2
    assert json.loads(error_file.read_text()) == record
    assert record["message"]["message"] == "zerotrain fit: error: --data.train_path: x.jsonl does not exist"


def test_a_lost_rank_or_a_crash_is_restarted_and_the_last_attempt_keeps_nothing(worker_env):
    worker_env(rank=0, attempt=0)
    lost = {"message": {"message": "zerotrain fit: rank 0: a collective lost its connection", "errorCode": 4}}
    assert not restarts.keep_final(4, lost)
    assert not restarts.keep_final(1, lost)
    worker_env(rank=0, attempt=2)  # no restart left: torchelastic ends the job with this attempt's records
    assert not restarts.keep_final(PREEMPTED_EXIT, lost)
    worker_env(rank=0, attempt=1)
    assert restarts.replay_final() is None  # nothing kept: this attempt trains


def test_a_restarted_worker_blanks_its_step_and_keeps_its_run(worker_env, tmp_path):
    (tmp_path / "rank1").write_text(f"{17:>12d}\n/runs/job\n")
    worker_env(rank=1, attempt=1)
    restarts.forget_step()
    assert read_progress(str(tmp_path)) == {1: {"step": None, "run_dir": "/runs/job"}}


def test_the_restart_line_names_the_killed_rank_without_the_jobs_end(tmp_path):
    killed = SimpleNamespace(exitcode=-9, local_rank=1, pid=11, timestamp=100, message="",
                             signal_name=lambda: "SIGKILL")
    stopped = SimpleNamespace(exitcode=-15, local_rank=0, pid=10, timestamp=101, message="",
                              signal_name=lambda: "SIGTERM")
    cause = restart_cause({0: stopped, 1: killed}, {0: {"step": 7, "run_dir": None}, 1: {"step": 7, "run_dir": None}})
    assert cause == "rank 1 (local rank 1) was killed by SIGKILL after step 7 (out of memory?)"


# ---- end to end: two workers on CPU (Gloo) -------------------------------------------------------

RUN = ["fit", "toy", "--trainer.device", "cpu", "--trainer.num_workers", "0", "--logging.progress_bar", "false",
       "--logging.tensorboard", "false", "--launch.nproc_per_node", "2", "--strategy.backend", "ddp",
       "--trainer.max_steps", "40", "--checkpoint.every_steps", "4", "--trainer.log_every_steps", "1"]


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "model.safetensors"))


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_restarted_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    import psutil
    import torch

    # The reference runs beside the killed job: one start-up paid for both.
    (tmp_path / "ref").mkdir()
    (tmp_path / "job").mkdir()
    ref = start_zerotrain([*RUN, "--trainer.output_dir", str(tmp_path / "runs"), "--trainer.run_name", "ref"],
                          tmp_path / "ref")
    folder = tmp_path / "progress"
    job = start_zerotrain([*RUN, "--trainer.output_dir", str(tmp_path / "runs"), "--launch.max_restarts", "1"],
                          tmp_path / "job", **{PROGRESS_ENV: str(folder)})
    try:
        deadline = time.monotonic() + 480  # start-up on 2 shared cores
        while (read_progress(str(folder)).get(1, {}).get("step") or 0) < 10:
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job" / "stderr.txt").read_text()
            time.sleep(0.05)
        (rank1,) = [p for p in psutil.Process(job.pid).children() if p.environ().get("RANK") == "1"]
        os.kill(rank1.pid, signal.SIGKILL)
        assert job.wait(timeout=300) == 0, (tmp_path / "job" / "stderr.txt").read_text()[-3000:]
        assert ref.wait(timeout=300) == 0, (tmp_path / "ref" / "stderr.txt").read_text()[-3000:]
    finally:
        for proc in (ref, job):
            if proc.poll() is None:
                proc.kill()
    err = (tmp_path / "job" / "stderr.txt").read_text()
    said = [line for line in err.splitlines() if line.startswith("zerotrain")]
    assert len(said) == 1, err[-3000:]
    # (On a loaded machine torchelastic may take the killed worker's status first: the line then says it ended first.)
    m = re.fullmatch(r"zerotrain: restart 1 of 1 \(--launch.max_restarts\): rank 1 \(local rank 1\) (?:was killed by "
                     r"SIGKILL|ended first,) after step (\d+) \([^;]*\); all workers restart and resume from step (\d+) "
                     r"\((\S+)\)", said[0])
    assert m, said[0]
    assert int(m[2]) <= int(m[1]) and int(m[2]) % 4 == 0
    assert f"resumed from {m[3]} at step {m[2]}" in err
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "ref"]  # the launcher named it for every attempt
    a, b = _weights(tmp_path / "runs" / "ref"), _weights(run)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_user_error_in_the_workers_is_not_restarted(tmp_path):
    proc = zerotrain_cmd([*RUN, "--trainer.output_dir", str(tmp_path / "runs"), "--launch.max_restarts", "2",
                          "--checkpoint.resume", str(tmp_path / "nowhere")], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("zerotrain")]
    assert len(said) == 1 and said[0].startswith("zerotrain fit: error: --checkpoint.resume"), proc.stderr[-3000:]


@pytest.mark.slow
def test_workers_pre_empted_on_their_own_end_the_job_with_the_requeue_status(tmp_path):
    """A stop signal that reaches the workers and not the launcher: they save and exit 75, which is not restarted."""
    import psutil

    folder = tmp_path / "progress"
    job = start_zerotrain([*RUN, "--trainer.max_steps", "100000", "--trainer.output_dir", str(tmp_path / "runs"),
                           "--trainer.run_name", "job", "--launch.max_restarts", "2"], tmp_path,
                          **{PROGRESS_ENV: str(folder)})
    try:
        deadline = time.monotonic() + 480  # start-up on 2 shared cores
        while len(now := read_progress(str(folder))) < 2 or min(p["step"] or 0 for p in now.values()) < 3:
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
            time.sleep(0.05)
        for worker in psutil.Process(job.pid).children():
            os.kill(worker.pid, signal.SIGTERM)
        assert job.wait(timeout=300) == PREEMPTED_EXIT, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    said = [line for line in (tmp_path / "stderr.txt").read_text().splitlines() if line.startswith("zerotrain")]
    assert len(said) == 1 and re.fullmatch(r"zerotrain fit: stopped by SIGTERM at step \d+; checkpoint \S+\. Run the "
                                           r"same command with --checkpoint.resume auto --trainer.run_name job to "
                                           r"continue \(exit status 75\)", said[0]), said
