"""Checkpoints end to end (in-process toy fits on CPU): crafted files, refused resumes, the run folder's lock."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from helpers import Evil, toy_config, train_log

from zerotrain.runtime import rundir
from zerotrain.checkpoint.layout import MARKER, complete_checkpoints
from zerotrain.errors import UserError
from zerotrain.train.loop import fit
from zerotrain.tasks.toy import ToyTask




def finished_run(tmp_path: Path, name: str, **strategy) -> Path:
    cfg = toy_config(tmp_path, name, **strategy)
    cfg.trainer.max_steps = 2
    return fit(ToyTask(cfg)).run_dir


def resume(tmp_path: Path, name: str, **strategy):
    cfg = toy_config(tmp_path, name, **strategy)
    cfg.trainer.max_steps = 4
    cfg.checkpoint.resume, cfg.checkpoint.verify = "auto", False  # the checksum would catch the swap first
    return fit(ToyTask(cfg))


@pytest.mark.parametrize("strategy,target", [
    (dict(backend="ddp"), "torch_state.pt"),
    (dict(zero_stage=2), "zero_pp_rank_0_mp_rank_00_optim_states.pt"),  # loaded inside DeepSpeed
    (dict(zero_stage=0), "mp_rank_00_model_states.pt"),
    (dict(zero_stage=0), "train_state_rank0.pt"),
])
def test_a_crafted_pickle_in_a_checkpoint_runs_no_code(tmp_path, strategy, target):
    run = finished_run(tmp_path, "crafted", **strategy)
    (folder,) = complete_checkpoints(run / "checkpoints")
    marker = tmp_path / "code-ran"
    path = folder / target
    path.write_bytes(pickle.dumps({"module": Evil(marker)}))
    meta = json.loads((folder / MARKER).read_text())
    meta["files"][target]["bytes"] = path.stat().st_size  # as an attacker who also edits the marker would
    (folder / MARKER).write_text(json.dumps(meta))
    with pytest.raises(UserError, match=rf"{target} cannot be loaded: .*could run code") as err:
        resume(tmp_path, "crafted", **strategy)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path):
    cfg = toy_config(tmp_path, "damaged", zero_stage=1)
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = 2, 3
    cfg.trainer.max_steps = 4
    run = fit(ToyTask(cfg)).run_dir
    newest = complete_checkpoints(run / "checkpoints")[-1]
    optim = next(newest.glob("*optim_states.pt"))
    data = bytearray(optim.read_bytes())
    data[-300:-236] = bytes(64)  # 64 bytes zeroed: the same size, another content
    optim.write_bytes(bytes(data))
    again = toy_config(tmp_path, "damaged", zero_stage=1)
    again.checkpoint.resume, again.trainer.max_steps = "auto", 6
    again.checkpoint.every_steps, again.checkpoint.keep_last = 2, 3
    assert fit(ToyTask(again)).final_step == 6
    straight = toy_config(tmp_path, "straight", zero_stage=1)
    straight.trainer.max_steps = 6
    a, b = train_log(fit(ToyTask(straight)).run_dir), train_log(run)
    assert [b[s]["train_loss"] for s in range(1, 7)] == [a[s]["train_loss"] for s in range(1, 7)]


@pytest.mark.parametrize("flag,value,message", [
    ("micro_batch_size", 4, "micro_batch_size 8, this run has 4"),
    ("zero_stage", 3, "zero_stage 0, this run has 3"),
    ("backend", "ddp", r"written by deepspeed ZeRO-0, which this run \(ddp\) cannot load .*pass --strategy.backend deepspeed"),
])
def test_another_shape_is_refused_before_the_run_folder_is_rewritten(tmp_path, flag, value, message):
    run = finished_run(tmp_path, "shape", zero_stage=0)
    before = {name: (run / name).read_bytes() for name in ("hparams.json", "ds_config.json", "metrics.jsonl")}
    cfg = toy_config(tmp_path, "shape", zero_stage=0)
    if flag == "micro_batch_size":
        cfg.trainer.micro_batch_size = value
    else:
        setattr(cfg.strategy, flag, value)
    cfg.checkpoint.resume, cfg.trainer.max_steps = "auto", 4
    with pytest.raises(UserError, match=message):
        fit(ToyTask(cfg))
    assert {name: (run / name).read_bytes() for name in before} == before


def test_a_second_fit_on_a_run_folder_in_use_is_refused_naming_the_pid(tmp_path):
    import os

    run = finished_run(tmp_path, "busy", zero_stage=0)
    hparams = (run / "hparams.json").read_bytes()
    with rundir.RunLock() as other:  # another fit holding the folder (flock conflicts across descriptors)
        other.take(run)
        cfg = toy_config(tmp_path, "busy", zero_stage=0)
        cfg.checkpoint.resume = "auto"
        with pytest.raises(UserError, match=rf"run folder .*busy is in use by process {os.getpid()} "):
            fit(ToyTask(cfg))
    assert (run / "hparams.json").read_bytes() == hparams
    assert fit(ToyTask(cfg)).final_step == 8  # released: the folder is free again


def test_a_run_killed_before_its_first_checkpoint_restarts_with_a_clean_log(tmp_path):
    cfg = toy_config(tmp_path, "early", zero_stage=0)
    cfg.trainer.max_steps, cfg.checkpoint.save_final = 3, False  # logged 3 steps, left no checkpoint
    run = fit(ToyTask(cfg)).run_dir
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train_lo')  # and died mid-line
    again = toy_config(tmp_path, "early", zero_stage=0)
    again.checkpoint.resume = "auto"
    fit(ToyTask(again))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(train_log(run)) == list(range(1, 9)) and steps == sorted(steps)


def test_a_crafted_pickle_in_a_cached_universal_checkpoint_runs_no_code(tmp_path, capsys):
    """A 1-process ZeRO-2 checkpoint whose marker says 2 processes x micro-batch 4 takes the resharding path in-process:
    converted once, the cache then reused, and its files loaded weights-only like every other checkpoint file."""
    import shutil

    run = finished_run(tmp_path, "uc", zero_stage=2)
    (folder,) = complete_checkpoints(run / "checkpoints")
    meta = json.loads((folder / MARKER).read_text())
    shutil.copy(folder / "train_state_rank0.pt", folder / "train_state_rank1.pt")
    meta["files"]["train_state_rank1.pt"] = meta["files"]["train_state_rank0.pt"]  # a copy: same size and sha256
    (folder / MARKER).write_text(json.dumps({**meta, "world_size": 2, "micro_batch_size": 4}))
    capsys.readouterr()
    assert resume(tmp_path, "uc", zero_stage=2).final_step == 4  # 1 process x micro 8: the same 8 per micro-step
    assert f"converting {folder} (written by 2 process(es))" in capsys.readouterr().err  # the log goes to stderr
    cached = folder / "universal"
    assert (cached / "UNIVERSAL.json").is_file() and not (folder / ".universal.tmp").exists()

    target = cached / "zero" / "0.weight" / "fp32.pt"
    code_ran = tmp_path / "code-ran"
    target.write_bytes(pickle.dumps({"param": Evil(code_ran)}))
    listing = json.loads((cached / "UNIVERSAL.json").read_text())
    listing["files"]["zero/0.weight/fp32.pt"] = {"bytes": target.stat().st_size}  # an attacker edits the listing too
    (cached / "UNIVERSAL.json").write_text(json.dumps(listing))
    cfg = toy_config(tmp_path, "uc-again", zero_stage=2)
    cfg.checkpoint.resume, cfg.checkpoint.verify, cfg.trainer.max_steps = str(folder), False, 3
    # Refused naming the file by the size check that comes before DeepSpeed's loader
    with pytest.raises(UserError, match=r"universal/zero/0\.weight/fp32\.pt cannot be loaded: .*could run code") as err:
        fit(ToyTask(cfg))
    logged = capsys.readouterr().err
    assert f"using the universal checkpoint cached in {cached}" in logged and "converting" not in logged
    assert "\n" not in str(err.value)
    assert not code_ran.exists()
