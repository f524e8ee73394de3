"""Files zerotrain is handed run no code, and run folders cannot write outside themselves (in-process toy fits on CPU).

* A crafted pickle (its ``__reduce__`` would create a file) anywhere zerotrain reads from a checkpoint or an export:
  resume, ``zerotrain export`` of ZeRO-2 and ZeRO-3 folders (DeepSpeed's own converter), ``zerotrain predict`` of a
  LoRA run. Each ends in one line with exit status 2, and the file is not created.
* Export checks a checkpoint as resume does: sizes, checksums, and a marker that lists every file.
* Symbolic links in a run folder that point outside it are refused before anything is written through them.
* A damaged checkpoint that resume skipped is moved aside, so it does not count in ``--checkpoint.keep_last``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Evil, toy_config

from zerotrain.checkpoint.layout import MARKER, complete_checkpoints, problem
from zerotrain.cli import main
from zerotrain.errors import UserError
from zerotrain.runtime import rundir
from zerotrain.tasks.toy import ToyTask
from zerotrain.train.loop import fit


def _fit(tmp_path: Path, name: str, steps: int, resume: bool = False, **strategy):
    cfg = toy_config(tmp_path, name, **strategy)
    cfg.trainer.max_steps = steps
    cfg.logging.tensorboard = False
    if resume:
        cfg.checkpoint.resume = "auto"
    return fit(ToyTask(cfg))


def _plant(folder: Path, name: str, marker_file: Path) -> None:
    """Replace ``folder/name`` by a pickle that would create ``marker_file`` (a bare pickle for optimizer files, one
    torch.save wrote for the others), and fix the checkpoint's marker to match (size and sha256), as an attacker
    who edits the marker too would: only weights-only loading stops it."""
    path = folder / name
    evil = {"module": Evil(marker_file), "optimizer_state_dict": Evil(marker_file)}
    if "optim" in name:
        path.write_bytes(pickle.dumps(evil))
    else:
        torch.save(evil, path)
    meta = json.loads((folder / MARKER).read_text())
    meta["files"][name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (folder / MARKER).write_text(json.dumps(meta))


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


# ---- code in a checkpoint ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("zero_runs")
    return {stage: _fit(root, f"zero{stage}", 2, zero_stage=stage).run_dir for stage in (2, 3)}


@pytest.mark.parametrize("stage,target", [
    (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    (2, "mp_rank_00_model_states.pt"),
    (3, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    (3, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
])
def test_export_of_a_crafted_zero_checkpoint_runs_no_code(zero_runs, tmp_path, stage, target, capsys):
    run = tmp_path / "run"
    shutil.copytree(zero_runs[stage], run)
    (folder,) = complete_checkpoints(run / "checkpoints")
    assert (folder / target).is_file()
    ran = tmp_path / "code-ran"
    _plant(folder, target, ran)
    capsys.readouterr()
    assert main(["export", str(run)]) == 2
    line = _one_line(capsys)
    assert f"{folder / target} cannot be loaded: " in line and "could run code" in line and "--step N" in line
    assert not ran.exists()
    assert not (run / "export").exists() or not any((run / "export").iterdir())


def test_resume_of_a_crafted_zero3_checkpoint_runs_no_code(tmp_path, capsys):
    run = _fit(tmp_path, "crafted3", 2, zero_stage=3).run_dir
    (folder,) = complete_checkpoints(run / "checkpoints")
    ran = tmp_path / "code-ran"
    _plant(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt", ran)  # checksums verified: the marker was edited
    with pytest.raises(UserError, match=r"optim_states\.pt cannot be loaded: .*could run code") as err:
        _fit(tmp_path, "crafted3", 4, resume=True, zero_stage=3)
    assert "\n" not in str(err.value)
    assert not ran.exists()


@pytest.mark.parametrize("damage,message", [
    ("flip", r"does not match its sha256 checksum"),
    ("no-files", r"COMPLETE\.json lists no files"),
    ("empty-files", r"COMPLETE\.json lists no files"),
    ("unlisted", r"extra_optim_states\.pt is not among the files its marker lists"),
])
def test_export_checks_the_checkpoint_before_reading_it(zero_runs, tmp_path, damage, message, capsys):
    run = tmp_path / "run"
    shutil.copytree(zero_runs[2], run)
    (folder,) = complete_checkpoints(run / "checkpoints")
    meta = json.loads((folder / MARKER).read_text())
    if damage == "flip":
        optim = next(folder.glob("*optim_states.pt"))
        data = bytearray(optim.read_bytes())
        data[-300] ^= 0xFF
        optim.write_bytes(bytes(data))
    elif damage == "no-files":
        del meta["files"]
    elif damage == "empty-files":
        meta["files"] = {}
    else:
        (folder / "extra_optim_states.pt").write_bytes(pickle.dumps(Evil(tmp_path / "code-ran")))
    (folder / MARKER).write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["export", str(run)]) == 2
    line = _one_line(capsys)
    assert re.search(message, line), line
    assert f"checkpoint {folder} is damaged" in line
    assert not (tmp_path / "code-ran").exists()


def test_predict_of_a_lora_run_with_a_pickled_adapter_is_one_line(tmp_path, tiny_tokenizer_dir, capsys):
    from helpers import LLAMA, write_run

    llama = dict(LLAMA, vocab_size=64)

    from zerotrain.tasks.lora import LoRAConfig, LoRATask

    (tmp_path / "llama.json").write_text(json.dumps(llama))
    cfg = LoRAConfig()
    cfg.model.init, cfg.model.config, cfg.model.tokenizer = "random", str(tmp_path / "llama.json"), str(tiny_tokenizer_dir)
    cfg.model.lora_r, cfg.model.merge_on_export = 4, False
    cfg.data.train_path = "unused.jsonl"
    cfg.precision.dtype = "fp32"
    task = LoRATask(cfg)
    torch.manual_seed(cfg.trainer.seed)
    run = write_run(tmp_path / "lora.run", task, task.build_model())
    adapter = run / "model" / "adapter"
    (adapter / "adapter_model.safetensors").unlink()  # peft then reads adapter_model.bin
    ran = tmp_path / "code-ran"
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"x": Evil(ran)}))
    capsys.readouterr()
    assert main(["predict", str(run), "a prompt"]) == 2
    line = _one_line(capsys)
    assert f"{adapter / 'adapter_model.bin'} is a pickle file, which zerotrain does not load" in line
    # Past load_run's check, peft's own (weights-only) loader is one line too.
    with pytest.raises(UserError, match=r"adapter cannot be loaded: it holds Python objects") as err:
        task.load_exported(task.build_model(pretrained=False), run / "model")
    assert "\n" not in str(err.value)
    assert not ran.exists()


# ---- a run folder is a closed room ------------------------------------------------------------------

LINKS = [  # (entry in the run folder, a folder?)
    (".lock", False),
    ("gitdiff.log", False),
    ("githash.log", False),
    ("metrics.jsonl", False),
    ("hparams.json", False),
    ("tb_dir", True),
    ("model", True),
    ("export", True),
    ("checkpoints", True),
    ("checkpoints/step00000002", True),
]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("entry,is_dir", LINKS, ids=[e for e, _ in LINKS])
def test_a_link_out_of_a_pre_created_run_folder_is_refused_and_nothing_is_written_there(tmp_path, entry, is_dir):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("mine\n")
    target = outside if is_dir else outside / "precious.txt"
    run = tmp_path / "runs" / "shared"
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    (run / entry).symlink_to(target, target_is_directory=is_dir)
    before = _snapshot(outside)
    with pytest.raises(UserError, match=rf"{run / entry} is a symbolic link to {outside}.*outside the run folder") as err:
        _fit(tmp_path / "runs", "shared", 2)
    assert "\n" not in str(err.value)
    assert _snapshot(outside) == before


def test_a_link_out_of_a_trained_run_is_refused_on_resume_and_export(tmp_path, capsys):
    run = _fit(tmp_path, "trained", 2).run_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "export").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError, match=r"export is a symbolic link to .*outside"):
        _fit(tmp_path, "trained", 4, resume=True)
    capsys.readouterr()
    assert main(["export", str(run)]) == 2
    assert "export is a symbolic link to" in _one_line(capsys)
    assert list(outside.iterdir()) == []


def test_a_run_folder_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "linked").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match=r"--trainer.run_name: .*linked is a symbolic link"):
        _fit(tmp_path / "runs", "linked", 2)
    assert list(elsewhere.iterdir()) == []


def test_files_written_in_place_are_opened_without_following_links(tmp_path):
    """Past the start-up check (a link made while the run goes): the lock and the metrics log refuse a link or a
    second hard link; githash.log and gitdiff.log replace the link instead of writing through it."""
    from zerotrain.config import LoggingConfig
    from zerotrain.metrics.tracking import Tracker

    outside = tmp_path / "precious.txt"
    outside.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.LOCK_FILE).symlink_to(outside)
    with pytest.raises(UserError, match=r"\.lock \(the run folder's lock\) is a symbolic link"):
        rundir.RunLock().take(run)
    os.link(outside, run / "metrics.jsonl")
    with pytest.raises(UserError, match=r"metrics\.jsonl \(the metrics log\) has other hard links"):
        rundir.open_own(run / "metrics.jsonl", os.O_WRONLY | os.O_APPEND, "the metrics log")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(UserError, match=r"metrics\.jsonl \(the run's metrics log\) is a symbolic link"):
        Tracker(run, LoggingConfig(tensorboard=False), {}, is_main=True, resumed_at=0)
    (run / "gitdiff.log").symlink_to(outside)
    rundir.write_code_state(run)
    assert not (run / "gitdiff.log").is_symlink()
    assert outside.read_text() == "mine\n"


def test_a_tb_dir_link_inside_the_run_is_replaced_on_a_restart(tmp_path):
    """A restart of a run that left no checkpoint clears its TensorBoard folder: a link there is removed as a link."""
    cfg = toy_config(tmp_path, "tb", zero_stage=0)
    cfg.trainer.max_steps, cfg.checkpoint.save_final = 2, False
    run = fit(ToyTask(cfg)).run_dir
    (run / "kept").mkdir()
    (run / "kept" / "note.txt").write_text("keep me\n")
    shutil.rmtree(run / "tb_dir")
    (run / "tb_dir").symlink_to(run / "kept", target_is_directory=True)
    assert fit(ToyTask(cfg)).final_step == 2
    assert (run / "tb_dir").is_dir() and not (run / "tb_dir").is_symlink()
    assert (run / "kept" / "note.txt").read_text() == "keep me\n"


@pytest.mark.parametrize("name", ["../../escaped", "/abs/run", "a/b", "new\nline", ".."])
def test_a_run_name_that_is_not_one_folder_name_is_refused(tmp_path, name):
    cfg = toy_config(tmp_path / "runs", name)
    with pytest.raises(UserError, match=r"^--trainer.run_name '.*' (holds|is no folder name)") as err:
        fit(ToyTask(cfg))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
    assert not Path("/abs").exists()


# ---- damaged checkpoints do not count -----------------------------------------------------------------

def test_a_damaged_checkpoint_skipped_by_resume_is_moved_aside_and_saved_again(tmp_path, capsys):
    cfg = toy_config(tmp_path, "keep", zero_stage=1)
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last, cfg.trainer.max_steps = 2, 2, 4
    run = fit(ToyTask(cfg)).run_dir
    ckpts = run / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step00000002", "step00000004"]
    optim = next((ckpts / "step00000004").glob("*optim_states.pt"))
    data = bytearray(optim.read_bytes())
    data[-300] ^= 0xFF  # one flipped byte: same size, caught by the checksum
    optim.write_bytes(bytes(data))

    cfg.checkpoint.resume, cfg.trainer.max_steps = "auto", 6
    capsys.readouterr()
    assert fit(ToyTask(cfg)).final_step == 6
    aside = sorted(p.name for p in ckpts.iterdir() if ".damaged-" in p.name)
    assert len(aside) == 1 and aside[0].startswith("step00000004.damaged-")
    assert f"moved the damaged checkpoint step00000004 aside to {ckpts / aside[0]}" in capsys.readouterr().err
    # Step 4 was saved again as training passed it; keep_last 2 kept it and 6, and step 2 went.
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step00000004", "step00000006"]
    assert all(problem(p, checksums=True) is None for p in complete_checkpoints(ckpts))
    # One more damaged checkpoint still leaves an intact one to resume from.
    (ckpts / "step00000006" / "train_state_rank0.pt").write_bytes(b"cut")
    cfg.trainer.max_steps = 8
    assert fit(ToyTask(cfg)).final_step == 8



def test_a_checkpoint_of_an_older_marker_format_is_refused_as_such_not_as_damaged(tmp_path, capsys):
    """A marker of format 1 (no file list) cannot be checked: resume and export refuse it in one line that says an
    older zerotrain wrote it, and it is not moved aside as damaged (nothing says it is)."""
    run = _fit(tmp_path, "old", 2).run_dir
    (folder,) = complete_checkpoints(run / "checkpoints")
    meta = json.loads((folder / MARKER).read_text())
    del meta["files"]
    meta["format"] = 1
    (folder / MARKER).write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"^--checkpoint.resume: .*step00000002 was written by an older zerotrain "
                                        r"\(its COMPLETE\.json is of format 1 and lists no files") as err:
        _fit(tmp_path, "old", 4, resume=True)
    assert "\n" not in str(err.value) and "damaged" not in str(err.value)
    assert complete_checkpoints(run / "checkpoints") == [folder]
    assert not any(".damaged-" in p.name for p in (run / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(["export", str(run)]) == 2
    line = _one_line(capsys)
    assert "was written by an older zerotrain" in line and "export it with the zerotrain version that wrote it" in line
