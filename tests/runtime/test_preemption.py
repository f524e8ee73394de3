"""Pre-emption: a stop signal becomes a checkpoint at the next step and exit status 75; a second one exits at once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import popen_zerotrain, toy_config, train_log, wait_for_rows

from zerotrain.checkpoint.layout import MARKER, complete_checkpoints, state_file
from zerotrain.train.loop import fit
from zerotrain.runtime.preemption import PREEMPTED_EXIT, SAME_EVENT_S, Preempted, Preemption
from zerotrain.tasks.toy import ToyTask


class SignalledToy(ToyTask):
    """The toy task, sending itself ``sig`` during its ``at``-th micro-batch (as a scheduler would, mid-step)."""

    sig, at = signal.SIGTERM, 5

    def training_step(self, model, batch):
        type(self).calls = getattr(type(self), "calls", 0) + 1
        if type(self).calls == self.at:
            os.kill(os.getpid(), self.sig)
        return super().training_step(model, batch)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_saves_at_the_next_step_and_the_resume_is_exact(tmp_path, sig):
    straight = fit(ToyTask(toy_config(tmp_path, "straight")))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    SignalledToy.sig, SignalledToy.calls = sig, 0
    with pytest.raises(Preempted, match=f"stopped by {sig.name} at step 3") as stop:
        fit(SignalledToy(toy_config(tmp_path, "preempted")))  # 2 micro-batches a step: the 5th is in step 3
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are gone with fit
    folder = stop.value.folder
    assert folder.name == "step00000003" and (folder / MARKER).is_file() and state_file(folder, 0).is_file()

    again = toy_config(tmp_path, "preempted")
    again.checkpoint.resume = "auto"
    resumed = fit(ToyTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(b) == list(range(1, 9))
    assert [b[s]["train_loss"] for s in sorted(b)] == [a[s]["train_loss"] for s in sorted(a)]


def test_a_second_signal_exits_at_once_but_a_forwarded_copy_does_not(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    p = Preemption()
    with p.armed():
        p._handle(signal.SIGTERM, None)
        assert p.requested and p.name() == "SIGTERM"
        p._handle(signal.SIGTERM, None)  # the launcher's forwarded copy, milliseconds later
        assert exits == []
        p._first_at -= SAME_EVENT_S + 0.1  # later: the user means it
        p._handle(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]


def test_alone_no_collective_is_needed():
    p = Preemption()
    assert p.should_stop(None) is False
    with p.armed():
        p._handle(signal.SIGUSR1, None)
    assert p.should_stop(None) is True


def test_outside_the_training_loop_a_signal_acts_at_once():
    """Loading data, building the model, the final test: no step to save at, so no deferral."""
    p = Preemption()
    with pytest.raises(KeyboardInterrupt):
        p._handle(signal.SIGINT, None)
    with pytest.raises(SystemExit) as stop:
        p._handle(signal.SIGTERM, None)
    assert stop.value.code == 128 + signal.SIGTERM and not p.requested


def test_the_requeue_hint_names_the_run():
    err = Preempted("SIGTERM", Path("runs/myrun/checkpoints/step00000012"), 12)
    assert str(err).endswith("--checkpoint.resume auto --trainer.run_name myrun to continue")


class _SignalState(torch.utils.data.Dataset):
    """Each item: whether SIGTERM is ignored and whether it is blocked, in the process that loads it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[bool, bool]:
        return (signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
                signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))


def test_loader_workers_are_forked_with_stop_signals_blocked_then_ignore_them(tmp_path):
    """A SIGTERM to the process group between a worker's fork and its init must not kill it: the worker
    is born with the signal blocked (a signal sent then waits), then ignores it and unblocks."""
    from zerotrain.data.loader import make_loader

    at_fork = tmp_path / "blocked_at_fork"
    armed = [True]

    def record() -> None:  # in each forked child, before anything of the loader runs
        if armed[0]:
            at_fork.write_text(str(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])))

    os.register_at_fork(after_in_child=record)
    try:
        loader = make_loader(_SignalState(), [[0, 1], [2, 3]], lambda items: items, workers=1, seed=0)
        seen = [item for batch in loader for item in batch]
    finally:
        armed[0] = False
    assert at_fork.read_text() == "True"
    assert seen == [(True, False)] * 4  # in the worker: ignored, no longer blocked
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this process: as before


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_to_the_command_saves_and_exits_75(tmp_path, nproc):
    """What SLURM/Kubernetes do: SIGTERM to the command (for 2 processes, the launcher, which forwards it)."""
    # A data-loader worker process too: torchrun signals the whole process group, and the loader's worker
    # must not die of it in the middle of the checkpoint.
    args = ["fit", "toy", "--trainer.max_steps", "100000", "--trainer.log_every_steps", "1", "--trainer.num_workers",
            "1", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "run", "--logging.progress_bar", "false",
            "--trainer.eval_every_steps", "100000", "--launch.nproc_per_node", str(nproc)]
    proc = popen_zerotrain(args, tmp_path)
    wait_for_rows(tmp_path / "run" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    assert "pre-empted by SIGTERM" in err or "stopped by SIGTERM" in err, err[-3000:]
    (folder,) = complete_checkpoints(tmp_path / "run" / "checkpoints")
    meta = json.loads((folder / MARKER).read_text())
    assert meta["world_size"] == nproc and all(state_file(folder, r).is_file() for r in range(nproc))
    assert 3 <= meta["step"] < 100000
    # The requeued command continues from that checkpoint.
    resumed = popen_zerotrain([*args[:3], str(meta["step"] + 2), *args[4:], "--checkpoint.resume", "auto"], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    steps = sorted(train_log(tmp_path / "run"))
    assert steps == list(range(1, meta["step"] + 3))  # nothing logged twice, nothing missing


@pytest.mark.slow
def test_a_signal_after_the_workers_saved_does_not_change_the_exit_status(tmp_path):
    """A scheduler signalling again while the launcher tears down, after its workers saved and exited with 75:
    the launcher still exits 75 (not by SIGTERM, which a job script would not requeue)."""
    import psutil

    args = ["fit", "toy", "--trainer.max_steps", "100000", "--trainer.log_every_steps", "1", "--trainer.num_workers",
            "0", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "run", "--logging.progress_bar", "false",
            "--trainer.eval_every_steps", "100000", "--launch.nproc_per_node", "2"]
    proc = popen_zerotrain(args, tmp_path)
    launcher = psutil.Process(proc.pid)
    try:
        wait_for_rows(tmp_path / "run" / "metrics.jsonl", proc)
        workers = launcher.children()
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(workers, timeout=120)
        assert not alive
        delivered = 0  # to the launcher still running (not a zombie), after its workers had exited
        while proc.poll() is None:
            try:
                if launcher.status() != psutil.STATUS_ZOMBIE:
                    launcher.send_signal(signal.SIGTERM)
                    delivered += 1
            except psutil.Error:
                pass
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert delivered > 0  # the launcher's teardown outlasts the workers, long enough to be signalled again
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (folder,) = complete_checkpoints(tmp_path / "run" / "checkpoints")
    assert json.loads((folder / MARKER).read_text())["world_size"] == 2
