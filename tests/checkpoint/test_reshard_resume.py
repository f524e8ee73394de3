"""Resume on another process count (2 -> 1 -> 2 processes on CPU, Gloo): ZeRO-1/2/3 through DeepSpeed's
universal checkpoint (converted once, cached beside the checkpoint), the plain engine and fp32 ZeRO-0 as they are.

Each run is compared with an uninterrupted 2-process run. Tolerance: fp32 on CPU, dropout off (the
one thing a resharded resume re-seeds instead of restoring), the same samples in every step. What
changes is where sums happen: one process averages the 16 examples of a step in one reduction, two
processes average 8 each and all-reduce, and ZeRO regroups the flat fp32 partitions. Those
reorderings move a result by a few float32 ulps (~1e-7 relative, seen: 3e-8), which Adam carries
over a few steps; rel 1e-5 leaves margin for that while a wrong sample, step, learning rate or
optimizer moment moves the loss by 1e-3 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import train_log, zerotrain_cmd

REL = 1e-5

COMMON = ["--trainer.log_every_steps", "1", "--trainer.num_workers", "0", "--logging.progress_bar", "false",
          "--model.dropout", "0", "--data.num_examples", "64", "--checkpoint.keep_last", "5",
          # a schedule that moves (x0.5 every 3 steps): the scheduler's restore is checked by the logged lr
          "--scheduler.name", "step", "--scheduler.step_unit", "steps", "--scheduler.step_size", "3",
          "--scheduler.gamma", "0.5", "--optimizer.lr", "1e-2"]


def fit(tmp_path: Path, name: str, strategy: list[str], procs: int, max_steps: int, resume: str | None = None,
        micro: int | None = None):
    micro = str(micro or 8 // procs)  # by default micro-batch x processes stays 8: the global batch of every run
    args = ["fit", "toy", *COMMON, *strategy, "--trainer.output_dir", str(tmp_path), "--trainer.run_name", name,
            "--trainer.max_steps", str(max_steps), "--trainer.micro_batch_size", micro,
            "--launch.nproc_per_node", str(procs)]
    if resume is not None:
        args += ["--checkpoint.resume", resume]
    out = zerotrain_cmd(args, tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "model" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    ["--strategy.zero_stage", "0"],  # fp32 ZeRO-0: the whole optimizer state is in one file, loaded as it is
    ["--strategy.zero_stage", "1"],
    ["--strategy.zero_stage", "2"],
    ["--strategy.zero_stage", "3"],
    ["--strategy.backend", "ddp"],
], ids=["zero0", "zero1", "zero2", "zero3", "plain"])
def test_two_one_two_processes_continue_the_uninterrupted_run(tmp_path, strategy):
    import torch

    converts = strategy[-1] in ("1", "2", "3")  # ZeRO-1/2/3 partition the optimizer state by rank
    fit(tmp_path, "straight", strategy, procs=2, max_steps=10)  # 8 steps an epoch: the split crosses it
    fit(tmp_path, "split", strategy, procs=2, max_steps=4)
    one = fit(tmp_path, "split", strategy, procs=1, max_steps=7, resume="auto")
    two = fit(tmp_path, "split", strategy, procs=2, max_steps=10, resume="auto")

    for out, saved, now in ((one, 2, 1), (two, 1, 2)):
        assert f"resumed on {now} process(es) from a checkpoint of {saved}" in out
        assert "not in dropout randomness" in out
    ckpts = tmp_path / "split" / "checkpoints"
    if converts:
        assert f"converting {ckpts / 'step00000004'} (written by 2 process(es))" in one
        assert f"converting {ckpts / 'step00000007'} (written by 1 process(es))" in two
        for step in (4, 7):
            assert (ckpts / f"step{step:08d}" / "universal" / "UNIVERSAL.json").is_file()
    else:
        assert "universal" not in one + two  # the state is whole (plain engine, ZeRO-0): nothing to convert
        assert not any(ckpts.glob("*/universal"))

    a, b = train_log(tmp_path / "straight"), train_log(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 11))  # the step count continues: no step twice, none lost
    for step in range(1, 11):
        assert b[step]["lr"] == a[step]["lr"], f"step {step}: the schedule did not continue"
        assert b[step]["train_loss"] == pytest.approx(a[step]["train_loss"], rel=REL), f"step {step}"
    assert a[10]["lr"] == pytest.approx(1e-2 * 0.5 ** 3)
    assert a[10]["train_loss"] != pytest.approx(a[1]["train_loss"], rel=1e-2)  # it trained
    wa, wb = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert sorted(wa) == sorted(wb)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=REL, atol=1e-7)
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["final_step"] == 10 and summary["world_size"] == 2

    if converts:  # a second resume from the same checkpoint reuses the cached conversion
        marker = ckpts / "step00000004" / "universal" / "UNIVERSAL.json"
        before = marker.stat().st_mtime_ns
        again = fit(tmp_path, "again", strategy, procs=1, max_steps=5, resume=str(ckpts / "step00000004"))
        assert f"using the universal checkpoint cached in {ckpts / 'step00000004' / 'universal'}" in again
        assert "converting" not in again
        assert marker.stat().st_mtime_ns == before
        assert train_log(tmp_path / "again")[5]["train_loss"] == pytest.approx(a[5]["train_loss"], rel=REL)
    else:
        assert not any((ckpts / f"step{step:08d}" / "universal").exists() for step in (4, 7))


@pytest.mark.slow
def test_one_process_resumes_two_with_the_same_flags_by_accumulating(tmp_path):
    """2 processes x micro 4 continue on 1 process given the same --trainer.micro_batch_size 4: accumulation 2
    keeps the global batch of 8, with one line saying so, and the run continues the uninterrupted one."""
    strategy = ["--strategy.zero_stage", "1"]
    fit(tmp_path, "straight", strategy, procs=2, max_steps=6, micro=4)
    fit(tmp_path, "split", strategy, procs=2, max_steps=3, micro=4)
    out = fit(tmp_path, "split", strategy, procs=1, max_steps=6, resume="auto", micro=4)
    assert ("resuming on 1 process(es) from a checkpoint of 2: gradient accumulation 2 (was 1) keeps its global "
            "batch of 8 (4 x 2 x 1)") in out
    a, b = train_log(tmp_path / "straight"), train_log(tmp_path / "split")
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step]["train_loss"] == pytest.approx(a[step]["train_loss"], rel=REL), f"step {step}"
