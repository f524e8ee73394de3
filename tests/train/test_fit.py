"""End-to-end fits of the toy task on CPU (Gloo): every ZeRO stage, offload, the DDP baseline, exact resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import toy_config, train_log, zerotrain_cmd

from zerotrain.checkpoint.layout import MARKER, complete_checkpoints
from zerotrain.train.loop import fit
from zerotrain.tasks.toy import ToyTask


STRATEGIES = {
    "zero0": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
    "zero2-cpu-offload": dict(zero_stage=2, offload_optimizer="cpu"),
    "ddp": dict(backend="ddp"),
}


@pytest.fixture
def strategy(request) -> dict:
    """STRATEGIES[name]; with CPU offload, DeepSpeed's CPU Adam op is built first, in the setup (conftest)."""
    if request.param.get("offload_optimizer") == "cpu":
        request.getfixturevalue("cpu_adam_built")
    return request.param


@pytest.mark.parametrize("strategy", [
    # CPU offload: 7-12 s of fits (DeepSpeedCPUAdam), after the op's one-time build (~1-2 min).
    pytest.param(s, id=name, marks=pytest.mark.slow if s.get("offload_optimizer") == "cpu" else ())
    for name, s in STRATEGIES.items()
], indirect=True)
def test_resume_is_exact(tmp_path, strategy):
    """2N steps in one run and N steps + resume + N steps give identical losses and gradient norms."""
    straight = fit(ToyTask(toy_config(tmp_path, "straight", **strategy)))

    first = toy_config(tmp_path, "split", **strategy)
    first.trainer.max_steps = 4
    fit(ToyTask(first))
    second = toy_config(tmp_path, "split", **strategy)
    second.checkpoint.resume = "auto"
    resumed = fit(ToyTask(second))

    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after resume"
        assert b[step]["lr"] == a[step]["lr"]
        # Every engine reports the norm (DeepSpeed's under ZeRO, a pass over .grad otherwise).
        assert a[step].get("grad_norm", 0) > 0, f"step {step}: no gradient norm logged: {a[step]}"
        assert b[step].get("grad_norm") == pytest.approx(a[step]["grad_norm"], rel=1e-6)
    # Training did something: the loss at the end is lower than at the start.
    assert a[8]["train_loss"] < a[1]["train_loss"]


def test_run_directory_contents(tmp_path):
    cfg = toy_config(tmp_path, "contents", zero_stage=1)
    cfg.checkpoint.every_steps = 2
    cfg.checkpoint.keep_last = 2
    result = fit(ToyTask(cfg))
    run = result.run_dir
    for name in ("hparams.json", "ds_config.json", "githash.log", "gitdiff.log", "env.json", "metrics.jsonl",
                 "summary.json", "model/model.safetensors"):
        assert (run / name).is_file(), name
    assert any((run / "tb_dir").iterdir()), "TensorBoard events"
    hparams = json.loads((run / "hparams.json").read_text())
    assert hparams["recipe"] == "toy" and hparams["strategy"]["zero_stage"] == 1
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 1 and ds["train_batch_size"] == 16
    kept = complete_checkpoints(run / "checkpoints")
    assert [p.name for p in kept] == ["step00000006", "step00000008"]  # keep_last=2 of 2, 4, 6, 8
    assert json.loads((kept[-1] / MARKER).read_text())["step"] == 8
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["throughput_tokens_per_s"] > 0 and "val_mse" in summary
    env = json.loads((run / "env.json").read_text())
    assert env["versions"]["torch"] and env["versions"]["deepspeed"]


def test_incomplete_checkpoint_is_ignored(tmp_path):
    cfg = toy_config(tmp_path, "killed", zero_stage=0)
    cfg.trainer.max_steps = 4
    run = fit(ToyTask(cfg)).run_dir
    # A save killed half-way: the folder exists, the marker does not.
    broken = run / "checkpoints" / "step00000006"
    broken.mkdir()
    (broken / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step00000004"]
    cfg2 = toy_config(tmp_path, "killed", zero_stage=0)
    cfg2.trainer.max_steps = 6
    cfg2.checkpoint.resume = "auto"
    result = fit(ToyTask(cfg2))
    assert result.final_step == 6
    assert (run / "checkpoints" / "step00000006" / MARKER).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_processes_on_gloo(tmp_path, stage, monkeypatch):
    """``--launch.nproc_per_node 2`` starts two ranks itself; both see the same data split in halves, and each has
    half the cores for its CPU threads."""
    from zerotrain.runtime.launcher import threads_per_worker

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = zerotrain_cmd(["fit", "toy", "--trainer.max_steps", "4", "--trainer.log_every_steps", "1", "--trainer.num_workers",
                "0", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "two", "--strategy.zero_stage",
                str(stage), "--launch.nproc_per_node", "2", "--logging.progress_bar", "false",
                # 17 validation examples: 2 batches on rank 0, 1 on rank 1 (ZeRO-3 must not hang on that).
                "--data.num_val_examples", "17"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "two"
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2 * ds["train_micro_batch_size_per_gpu"]
    env = json.loads((run / "env.json").read_text())
    assert env["launcher_env"]["WORLD_SIZE"] == "2"
    assert env["omp_num_threads"] == str(threads_per_worker(2)) and env["cpu_threads"] == threads_per_worker(2)
    assert env["cpu_affinity"] == len(os.sched_getaffinity(0))
    assert len(train_log(run)) == 4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_mse"] > 0
    # ZeRO-3 shards parameters across both ranks: the export must still hold full weights.
    from safetensors.torch import load_file

    weights = load_file(run / "model" / "model.safetensors")
    assert weights["0.weight"].shape == (32, 8)


def test_deepspeed_launcher_local_rank_flag_is_accepted():
    from zerotrain.cli.fit import _drop_local_rank

    assert _drop_local_rank(["--local_rank=1", "--trainer.max_steps", "2"]) == ["--trainer.max_steps", "2"]
    assert _drop_local_rank(["--local_rank", "0", "--x", "1"]) == ["--x", "1"]


def test_logged_lr_is_the_rate_the_step_used(tmp_path):
    cfg = toy_config(tmp_path, "lr", backend="ddp")
    cfg.scheduler.name, cfg.scheduler.warmup_steps = "constant", 4
    rows = train_log(fit(ToyTask(cfg)).run_dir)
    assert [rows[s]["lr"] for s in (1, 2, 4, 8)] == pytest.approx([cfg.optimizer.lr * f for f in (0.25, 0.5, 1, 1)])


@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_resume_after_a_kill_logs_what_an_uninterrupted_run_logs(tmp_path, backend):
    """Killed at step 6 with the last checkpoint at 4, mid log window: the resumed log equals the straight one."""
    def cfg(name: str):
        c = toy_config(tmp_path, name, backend=backend, zero_stage=0)
        c.trainer.log_every_steps = 3  # windows end at 3, 6, 8: the checkpoint at 4 falls inside one
        c.checkpoint.every_steps = 4
        return c

    straight = fit(ToyTask(cfg("straight")))
    killed = cfg("killed")
    killed.trainer.max_steps, killed.checkpoint.save_final = 6, False  # rows up to 6, checkpoint at 4
    fit(ToyTask(killed))
    again = cfg("killed")
    again.checkpoint.resume = "auto"
    resumed = fit(ToyTask(again))

    def rows(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(straight.run_dir), rows(resumed.run_dir)
    assert [r["step"] for r in b] == [r["step"] for r in a]  # nothing logged twice
    for key in ("train_loss", "lr", "val_mse"):  # compared below: each must be logged, not absent on both sides
        assert any(key in r for r in a), key
    for x, y in zip(a, b):
        for key in ("train_loss", "lr", "val_mse"):
            assert x.get(key) == y.get(key), (x["step"], key)

    # TensorBoard shows the same curve: the killed run's points after step 4 are purged, not doubled.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def tb_curve(run):
        events = EventAccumulator(str(run / "tb_dir"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train_loss")]

    assert tb_curve(resumed.run_dir) == tb_curve(straight.run_dir)


@pytest.mark.parametrize("backend", ["deepspeed", "ddp"])
def test_fit_leaves_the_process_as_it_found_it(tmp_path, monkeypatch, backend):
    """No process group, launcher variable, backend flag, log handler, gc callback or frozen heap outlives fit(), and the
    config it was handed is not rewritten (precision stays 'auto'); a second fit in the same process works."""
    import logging
    import os

    import torch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = dict(os.environ)
    handlers = list(logging.getLogger("zerotrain").handlers)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    import signal

    import gc

    signal_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    gc_callbacks = list(gc.callbacks)
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda freeze=gc.freeze: freezes.append(1) or freeze())
    cfg = toy_config(tmp_path, f"clean-{backend}", backend=backend)
    cfg.trainer.max_steps, cfg.trainer.warmup_steps_excluded = 2, 1  # the heap is frozen after step 1
    fit(ToyTask(cfg))
    assert freezes == [1] and gc.get_freeze_count() == 0  # and thawed again
    assert not torch.distributed.is_initialized()
    assert {k: v for k, v in os.environ.items() if k not in env} == {}
    assert {k for k in env if os.environ.get(k) != env[k]} == set()
    assert logging.getLogger("zerotrain").handlers == handlers
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32
    assert cfg.precision.dtype == "auto"
    assert {s: signal.getsignal(s) for s in signal_handlers} == signal_handlers  # the pre-emption handlers are gone
    assert gc.callbacks == gc_callbacks  # the meter's garbage-collection clock is gone too
    cfg.trainer.run_name = f"again-{backend}"
    assert fit(ToyTask(cfg)).final_step == 2


def test_a_resumed_run_profiles_the_steps_after_its_own_warm_up(tmp_path):
    """The warm-up restarts with the process, so does the profile's start: a run resumed past the first
    run's warm-up still writes its profile (it used to wait for a step it had already passed)."""
    first = toy_config(tmp_path, "profiled", backend="ddp")
    first.trainer.max_steps = 4
    fit(ToyTask(first))
    second = toy_config(tmp_path, "profiled", backend="ddp")
    second.checkpoint.resume = "auto"
    second.trainer.profile_steps, second.trainer.warmup_steps_excluded = 2, 2  # steps 7 and 8 of the 8
    run = fit(ToyTask(second)).run_dir
    assert json.loads((run / "profile.json").read_text())["steps"] == 2


class _FailsAtStep3(ToyTask):
    """The toy task whose third optimizer step raises (two micro-batches a step)."""

    micro_batches = 0

    def training_step(self, model, batch):
        type(self).micro_batches += 1
        if type(self).micro_batches > 4:
            raise RuntimeError("step 3 fails")
        return super().training_step(model, batch)


def test_a_fit_that_fails_after_the_heap_froze_thaws_it(tmp_path, monkeypatch):
    import gc

    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda freeze=gc.freeze: freezes.append(1) or freeze())
    cfg = toy_config(tmp_path, "fails")
    cfg.trainer.warmup_steps_excluded = 1
    with pytest.raises(RuntimeError, match="step 3 fails"):
        fit(_FailsAtStep3(cfg))
    assert freezes == [1] and gc.get_freeze_count() == 0


def _fast_and_default_logs(tmp_path: Path, stage: int, steps: int, profile_steps: int = 0,
                           **strategy) -> dict[bool, dict[int, dict]]:
    """The train log, every 10 steps, of the fast path and of DeepSpeed's default path, with clipping that bites."""
    logs = {}
    for fast in (True, False):
        cfg = toy_config(tmp_path, f"fast-{fast}", zero_stage=stage, fast_path=fast, gradient_clipping=0.05, **strategy)
        cfg.trainer.max_steps, cfg.trainer.log_every_steps, cfg.trainer.eval_every_steps = steps, 10, steps
        cfg.trainer.profile_steps, cfg.trainer.warmup_steps_excluded = profile_steps, 2
        cfg.scheduler.name = "constant"
        fit(ToyTask(cfg))
        logs[fast] = train_log(tmp_path / f"fast-{fast}")
    assert sorted(logs[True]) == sorted(logs[False]) == list(range(10, steps + 1, 10))
    for step, row in logs[True].items():
        assert row["train_loss"] == pytest.approx(logs[False][step]["train_loss"], rel=1e-5, abs=1e-7), step
        if "grad_norm" in logs[False][step]:  # DeepSpeed's own ZeRO-0 path logs none
            assert row["grad_norm"] == pytest.approx(logs[False][step]["grad_norm"], rel=1e-5), step
    return logs


def test_fast_path_follows_deepspeeds_default_path(tmp_path):
    """200 steps of ZeRO-0: the fast path (engine-side clip, timers off) gives the loss curve of DeepSpeed's
    own path within fp32 rounding (the GPU row in BENCHMARKS.md checks bf16)."""
    logs = _fast_and_default_logs(tmp_path, stage=0, steps=200)
    assert logs[True][200]["train_loss"] < 0.5 * logs[True][10]["train_loss"]  # it did learn
    assert logs[True][200]["grad_norm"] > 0.05  # clipping was active all along


@pytest.mark.slow
def test_offload_fast_path_reads_the_grad_norm_once(tmp_path, cpu_adam_built):
    """ZeRO-2 + CPU optimizer offload: DeepSpeed reads each gradient tensor's norm to the host (one
    .item() each); the fast path reads their sum once. Same loss and grad-norm curves."""
    logs = _fast_and_default_logs(tmp_path, stage=2, steps=30, profile_steps=3, offload_optimizer="cpu")
    assert all("grad_norm" in row for row in logs[False].values())
    reads = {fast: json.loads((tmp_path / f"fast-{fast}" / "profile.json").read_text())["device_reads_per_step"]
             for fast in (True, False)}
    tensors = len(list(ToyTask(toy_config(tmp_path, "count")).build_model().parameters()))
    # DeepSpeed: one read per tensor, one of the all-reduced sum and one in its clip; the fast path: the sum's only
    assert tensors >= 4 and reads[True] == pytest.approx(reads[False] - tensors - 1)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_fast_path_follows_deepspeeds_default_path(tmp_path, stage):
    """ZeRO-1/2 without contiguous_gradients and with the clip that reads nothing to the host (the fast path)
    reduce and clip the same gradients: DeepSpeed's own curve, with two device reads a step fewer (its clip
    reads the norm's validity, its norm mask the -1 it fills with)."""
    logs = _fast_and_default_logs(tmp_path, stage=stage, steps=60, profile_steps=3)
    assert all("grad_norm" in row for row in logs[False].values())  # so the grad norms were compared too
    reads = {fast: json.loads((tmp_path / f"fast-{fast}" / "profile.json").read_text())["device_reads_per_step"]
             for fast in (True, False)}
    assert reads[True] == pytest.approx(reads[False] - 2)
    ds = json.loads((tmp_path / "fast-True" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["contiguous_gradients"] is False


def test_the_training_workers_start_before_the_model_and_engine_exist(tmp_path, monkeypatch):
    """Forked after the engine, a worker would share the engine's host memory page by page, and every page the
    training process wrote later (an offloaded optimizer's states, each step) would be copied: a 5.5B ZeRO-2
    offload outgrew its 125 GiB host that way. The workers must be running when the model is built; the run
    trains on the same batches as one that reads in-process (the workers' early batches are dropped), also
    when it resumes mid-epoch; and a failure after they started leaves none behind."""
    import psutil

    from zerotrain.train import loop

    before = len(psutil.Process().children())
    seen = {}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            seen.setdefault(name, len(psutil.Process().children()) - before)
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ToyTask, "build_model", counting("model", ToyTask.build_model))
    monkeypatch.setattr(loop, "build_engine", counting("engine", loop.build_engine))

    def cfg(name, workers, steps=8):
        c = toy_config(tmp_path, name, zero_stage=0)
        c.trainer.num_workers, c.trainer.max_steps = workers, steps
        return c

    early = fit(ToyTask(cfg("early", 2)))
    assert seen == {"model": 2, "engine": 2}
    assert len(psutil.Process().children()) == before  # stopped when fit returned
    in_process = fit(ToyTask(cfg("in_process", 0)))
    fit(ToyTask(cfg("resumed", 2, steps=4)))  # 3 steps an epoch: the resume lands mid-epoch
    again = cfg("resumed", 2)
    again.checkpoint.resume = "auto"
    resumed = fit(ToyTask(again))
    a, b, c = (train_log(r.run_dir) for r in (early, in_process, resumed))
    assert a.keys() == b.keys() == c.keys() == set(range(1, 9))
    assert [a[s]["train_loss"] for s in a] == [b[s]["train_loss"] for s in a] == [c[s]["train_loss"] for s in a]

    def failing(*args, **kwargs):
        raise RuntimeError("the tracker could not start")

    monkeypatch.setattr(loop, "Tracker", failing)
    with pytest.raises(RuntimeError, match="tracker") as held:  # the traceback, and its frames, still held here
        fit(ToyTask(cfg("failing", 2)))
    assert held.value and len(psutil.Process().children()) == before


def test_a_fit_that_fails_in_a_callers_group_leaves_the_next_fit_a_working_deepspeed(tmp_path, monkeypatch):
    """main() in a process group the caller made: a DeepSpeed fit that stops with an error (the CLI then ends the
    group, as after every error), then a fit in a group of its own. DeepSpeed's cached groups must go with the
    ended group, or the second fit's model broadcast finds a group torch no longer knows."""
    import torch.distributed as dist

    from zerotrain.cli import main
    from zerotrain.errors import DIVERGED_EXIT
    from zerotrain.runtime.distributed import free_port

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", world_size=1, rank=0)
    try:
        # Adam steps of 1e30 overflow the toy's loss at once: the run stops as diverged after its engine was built.
        code = main(["fit", "toy", "--trainer.device", "cpu", "--trainer.num_workers", "0", "--trainer.max_steps", "6",
                     "--trainer.log_every_steps", "1", "--optimizer.lr", "1e30", "--logging.progress_bar", "false",
                     "--logging.tensorboard", "false", "--checkpoint.save_final", "false", "--trainer.export", "false",
                     "--trainer.output_dir", str(tmp_path)])
        assert code == DIVERGED_EXIT
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key)
    cfg = toy_config(tmp_path, "after-the-failed-one", zero_stage=1)
    cfg.trainer.max_steps = 2
    assert fit(ToyTask(cfg)).final_step == 2


def test_report_hears_each_logged_step_and_each_checkpoint(tmp_path):
    """fit's ``report`` (what zerotrain.ray hands Ray Train) is called after each step that logged or saved, with
    what was logged there and the complete checkpoint folder saved there."""
    cfg = toy_config(tmp_path, "reported", zero_stage=1)
    cfg.trainer.log_every_steps = 3
    cfg.checkpoint.every_steps = 4
    calls = []

    def report(step, metrics, checkpoint):
        calls.append((step, dict(metrics), checkpoint))
        if checkpoint is not None:
            assert (checkpoint / MARKER).is_file()  # sealed before it is reported

    result = fit(ToyTask(cfg), report=report)
    assert [(step, checkpoint.name if checkpoint else None) for step, _, checkpoint in calls] == [
        (3, None), (4, "step00000004"), (6, None), (8, "step00000008")]
    assert [set(m) >= {"train_loss", "lr"} for _, m, _ in calls] == [True, False, True, True]
    assert calls[-1][1]["train_loss"] == train_log(result.run_dir)[8]["train_loss"]
    assert "val_mse" in calls[-1][1]  # the last step validates
