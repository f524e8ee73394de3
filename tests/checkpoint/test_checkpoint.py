"""The checkpointer: when it saves, what a complete folder holds, pruning, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerotrain.checkpoint.manager import Checkpointer

from zerotrain.checkpoint.layout import find_resume_folder

from zerotrain.checkpoint.layout import MARKER, complete_checkpoints, state_file, step_folder
from zerotrain.config import CheckpointConfig
from zerotrain.errors import UserError
from zerotrain.train.state import TrainState


class FakeEngine:
    """One rank; its 'sharded state' is one tensor file."""

    rank, world_size = 0, 1

    def __init__(self):
        self.weight = torch.arange(4.0)

    def barrier(self) -> None: ...

    def save(self, folder: Path) -> None:
        torch.save({"w": self.weight}, folder / "engine.pt")

    def load(self, folder: Path) -> None:
        self.weight = torch.load(folder / "engine.pt", weights_only=True)["w"]


def checkpointer(tmp_path: Path, **cfg) -> Checkpointer:
    return Checkpointer(CheckpointConfig(**cfg), tmp_path, FakeEngine(), TrainState())


def test_should_save_every_n_steps_and_at_the_end_once(tmp_path):
    ck = checkpointer(tmp_path, every_steps=3, save_final=True)
    assert [s for s in range(1, 10) if ck.should_save(s)] == [3, 6, 9]
    assert ck.should_save(10, last_step=True)
    ck.state.step = 9
    ck.save()
    assert not ck.should_save(9, last_step=True)  # the final step was just saved
    assert not checkpointer(tmp_path, every_steps=0, save_final=False).should_save(5, last_step=True)


def test_save_writes_engine_state_marker_last_and_prunes(tmp_path):
    ck = checkpointer(tmp_path, every_steps=1, keep_last=2)
    for step in (1, 2, 3):
        ck.state.step = step
        folder = ck.save()
        assert json.loads((folder / MARKER).read_text())["step"] == step
        assert state_file(folder, 0).is_file() and (folder / "engine.pt").is_file()
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step00000002", "step00000003"]


def test_debris_of_a_killed_save_is_removed_and_never_resumed(tmp_path):
    ck = checkpointer(tmp_path, every_steps=1, keep_last=3)
    ck.state.step = 2
    ck.save()
    debris = step_folder(tmp_path / "checkpoints", 1)  # older, no marker: a save that was killed
    debris.mkdir()
    killed_later = step_folder(tmp_path / "checkpoints", 5)
    killed_later.mkdir()
    assert find_resume_folder("auto", tmp_path) == step_folder(tmp_path / "checkpoints", 2)
    ck.state.step = 3
    ck.save()
    assert not debris.exists()
    with pytest.raises(UserError, match="incomplete checkpoint"):
        find_resume_folder(str(killed_later), None)


def test_load_restores_engine_and_state(tmp_path):
    ck = checkpointer(tmp_path)
    ck.state.advance(0.5, epoch=2, batches_in_epoch=4)
    folder = ck.save()
    fresh = checkpointer(tmp_path)
    fresh.engine.weight = torch.zeros(4)
    fresh.load(folder)
    assert torch.equal(fresh.engine.weight, torch.arange(4.0))
    assert fresh.state.plain() == {"step": 1, "epoch": 2, "batches_in_epoch": 4}
    assert not fresh.should_save(1, last_step=True)  # resumed at its own checkpoint: nothing to rewrite


def test_missing_train_state_is_refused_not_resumed_inexactly(tmp_path):
    ck = checkpointer(tmp_path)
    folder = ck.save()
    state_file(folder, 0).unlink()
    with pytest.raises(UserError, match="train_state_rank0.pt is missing"):
        checkpointer(tmp_path).load(folder)


class ReshardingEngine(FakeEngine):
    def load_resharded(self, folder: Path, saved_world_size: int, verify: bool = True) -> None:
        self.resharded_from = saved_world_size
        self.load(folder)


SHAPE = {"recipe": "toy", "backend": "deepspeed", "zero_stage": 2, "precision": "fp32", "micro_batch_size": 4,
         "grad_accum": 2}


def two_rank_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint as 2 processes x micro-batch 4 leave it: rank 1's train state beside rank 0's."""
    ck = Checkpointer(CheckpointConfig(verify=False), tmp_path, FakeEngine(), TrainState(),
                      {**SHAPE, "world_size": 2})
    ck.state.advance(1.0, epoch=1, batches_in_epoch=6)
    folder = ck.save()
    rank1 = TrainState(step=1, epoch=1, batches_in_epoch=6, window_loss=3.0, window_steps=1)
    torch.save(rank1.state_dict(), state_file(folder, 1))
    return folder


def test_another_process_count_keeps_step_and_position_and_reseeds_rng(tmp_path, caplog):
    folder = two_rank_checkpoint(tmp_path)
    draws = []
    for _ in range(2):
        ck = Checkpointer(CheckpointConfig(), tmp_path, ReshardingEngine(), TrainState(),
                          {**SHAPE, "micro_batch_size": 8, "world_size": 1})
        with caplog.at_level("WARNING", logger="zerotrain"):
            ck.load(folder, seed=7)
        assert ck.engine.resharded_from == 2
        assert ck.state.plain() == {"step": 1, "epoch": 1, "batches_in_epoch": 6}
        assert ck.state.window_loss == 2.0 and ck.state.window_steps == 1  # the mean of the ranks' sums
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])  # re-seeded from (seed, step, rank): deterministic
    assert "resumed on 1 process(es) from a checkpoint of 2" in caplog.text
    assert "not in dropout randomness" in caplog.text


def test_ranks_that_disagree_on_the_position_are_refused(tmp_path):
    folder = two_rank_checkpoint(tmp_path)
    torch.save(TrainState(step=1, epoch=1, batches_in_epoch=4).state_dict(), state_file(folder, 1))
    ck = Checkpointer(CheckpointConfig(), tmp_path, ReshardingEngine(), TrainState(),
                      {**SHAPE, "micro_batch_size": 8, "world_size": 1})
    with pytest.raises(UserError, match="the checkpoint's ranks disagree on where training stands"):
        ck.load(folder)


def test_another_process_count_needs_the_same_global_batch(tmp_path):
    from zerotrain.checkpoint.manager import check_compatible

    folder = two_rank_checkpoint(tmp_path)  # 2 processes x micro 4 x accumulation 2: global batch 16
    check_compatible(folder, {**SHAPE, "micro_batch_size": 8, "world_size": 1})  # 1 x 8 x 2: kept, no error
    check_compatible(folder, {**SHAPE, "micro_batch_size": 2, "world_size": 4})
    check_compatible(folder, {**SHAPE, "grad_accum": 4, "world_size": 1})  # 1 x 4 x 4: kept by accumulating
    with pytest.raises(UserError, match=r"^--checkpoint.resume: .* was written by 2 processes x micro-batch 4 x "
                                        r"accumulation 2 \(global batch 16\), this run has 1 x 4 x 2 \(global batch "
                                        r"8\)\. A resume keeps the global batch: pass "
                                        r"--strategy.gradient_accumulation_steps 4, or start it with 2 processes$") as err:
        check_compatible(folder, {**SHAPE, "world_size": 1})
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"this run has 3 x 4 x 2 .* pass a --trainer.micro_batch_size that, times 3 "
                                        r"process\(es\), divides 16"):
        check_compatible(folder, {**SHAPE, "world_size": 3})
    # The loader applies the same rule (a Checkpointer used without check_compatible).
    ck = Checkpointer(CheckpointConfig(), tmp_path, ReshardingEngine(), TrainState(), {**SHAPE, "world_size": 1})
    with pytest.raises(UserError, match="pass --strategy.gradient_accumulation_steps 4"):
        ck.load(folder)


def test_the_position_is_converted_to_the_micro_steps_of_another_split(tmp_path):
    folder = two_rank_checkpoint(tmp_path)  # 6 micro-steps of 2 x 4 examples into epoch 1
    ck = Checkpointer(CheckpointConfig(), tmp_path, ReshardingEngine(), TrainState(),
                      {**SHAPE, "micro_batch_size": 4, "grad_accum": 4, "world_size": 1})
    ck.load(folder)
    assert ck.state.plain() == {"step": 1, "epoch": 1, "batches_in_epoch": 12}  # micro-steps of 1 x 4


def test_accumulation_follows_the_process_count_to_keep_the_global_batch(tmp_path):
    from zerotrain.checkpoint.manager import keep_global_batch
    from zerotrain.tasks.toy import ToyConfig

    folder = two_rank_checkpoint(tmp_path)  # global batch 16 = 4 x 2 x 2
    cfg = ToyConfig()
    cfg.trainer.micro_batch_size, cfg.strategy.gradient_accumulation_steps = 4, 2
    assert keep_global_batch(folder, cfg, 2) is None  # the same count: nothing to change
    said = keep_global_batch(folder, cfg, 1)
    assert cfg.strategy.gradient_accumulation_steps == 4
    assert said == ("resuming on 1 process(es) from a checkpoint of 2: gradient accumulation 4 (was 2) keeps its "
                    "global batch of 16 (4 x 4 x 1)")
    cfg.trainer.micro_batch_size = 8  # 8 x 3 processes does not divide 16
    with pytest.raises(UserError, match=r"global batch of 16 \(micro-batch 4 x accumulation 2 x 2 processes\); 3 "
                                        r"process\(es\) x --trainer.micro_batch_size 8 does not divide it: use a "
                                        r"process count that divides 16, or resume it on 2 processes$"):
        keep_global_batch(folder, cfg, 3)
    with pytest.raises(UserError, match=r"4 process\(es\) x --trainer.micro_batch_size 8 does not divide it: pass "
                                        r"--trainer.micro_batch_size 4 \(one of \[1, 2, 4\]\)"):
        keep_global_batch(folder, cfg, 4)


def test_an_engine_that_cannot_reshard_is_one_line(tmp_path):
    from zerotrain.engines.base import Engine

    folder = two_rank_checkpoint(tmp_path)
    engine = FakeEngine()
    engine.load_resharded = lambda folder, n, verify=True: Engine.load_resharded(engine, folder, n, verify)
    ck = Checkpointer(CheckpointConfig(), tmp_path, engine, TrainState(),
                      {**SHAPE, "micro_batch_size": 8, "world_size": 1})
    with pytest.raises(UserError, match=r"written by 2 processes and this engine cannot resume it on 1\. Start it "
                                        r"with 2 processes"):
        ck.load(folder)


# ---- integrity: sizes and checksums in the marker, fallback to the previous intact checkpoint --------
def two_checkpoints(tmp_path: Path, **cfg) -> tuple[Path, Path]:
    ck = checkpointer(tmp_path, every_steps=1, keep_last=3, **cfg)
    ck.state.step = 1
    older = ck.save()
    ck.state.step = 2
    ck.engine.weight = torch.arange(4.0) * 2
    return older, ck.save()


def test_marker_lists_every_file_with_size_and_sha256(tmp_path):
    import hashlib

    _, folder = two_checkpoints(tmp_path)
    files = json.loads((folder / MARKER).read_text())["files"]
    assert sorted(files) == ["engine.pt", "train_state_rank0.pt"]
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_truncated_file_falls_back_to_the_previous_checkpoint_with_a_warning(tmp_path, caplog):
    older, newer = two_checkpoints(tmp_path)
    data = (newer / "engine.pt").read_bytes()
    (newer / "engine.pt").write_bytes(data[: len(data) // 2])
    with caplog.at_level("WARNING", logger="zerotrain"):
        assert find_resume_folder("auto", tmp_path) == older
        assert find_resume_folder(str(tmp_path), None) == older  # a run folder: the same choice
    assert "engine.pt has" in caplog.text and "falling back" in caplog.text
    # Named explicitly, a damaged step folder is refused (not swapped for another), naming the file.
    with pytest.raises(UserError, match=r"--checkpoint.resume: .*step00000002/engine.pt has \d+ bytes"):
        find_resume_folder(str(newer), None)


def test_missing_rng_state_file_falls_back(tmp_path):
    older, newer = two_checkpoints(tmp_path)
    state_file(newer, 0).unlink()
    assert find_resume_folder("auto", tmp_path) == older


def test_flipped_bytes_are_caught_by_the_checksum_only_when_verifying(tmp_path):
    older, newer = two_checkpoints(tmp_path)
    path = newer / "engine.pt"
    data = bytearray(path.read_bytes())
    data[-200:-136] = bytes(b ^ 0xFF for b in data[-200:-136])  # 64 bytes, same size
    path.write_bytes(bytes(data))
    assert find_resume_folder("auto", tmp_path, verify=True) == older
    assert find_resume_folder("auto", tmp_path, verify=False) == newer  # sizes alone cannot see it
    with pytest.raises(UserError, match="engine.pt does not match its sha256"):
        find_resume_folder(str(newer), None, verify=True)


def test_every_checkpoint_damaged_is_one_line(tmp_path):
    older, newer = two_checkpoints(tmp_path)
    for folder in (older, newer):
        (folder / "engine.pt").write_bytes(b"x")
    with pytest.raises(UserError, match="every checkpoint under .* is damaged"):
        find_resume_folder("auto", tmp_path)


def test_without_verify_no_checksums_are_written(tmp_path):
    _, folder = two_checkpoints(tmp_path, verify=False)
    files = json.loads((folder / MARKER).read_text())["files"]
    assert all(set(entry) == {"bytes"} for entry in files.values())


def test_crafted_train_state_does_not_run_code(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    folder = checkpointer(tmp_path).save()
    state_file(folder, 0).write_bytes(pickle.dumps({"version": 1, "x": Evil()}))
    with pytest.raises(UserError, match=r"train_state_rank0.pt cannot be loaded: .*could run code"):
        checkpointer(tmp_path).load(folder)
    assert not marker.exists()


# ---- a full disk -------------------------------------------------------------------------------------
def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    older, _ = two_checkpoints(tmp_path)
    ck = checkpointer(tmp_path, every_steps=1, keep_last=3)
    ck.state.step = 3

    def full(*args, **kwargs):  # what torch.save raises when the disk fills up mid-file
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError, match=r"no space left to write checkpoint step00000003 in .*checkpoints "
                                        r"\(.* free, about .* needed\).*step00000002 is untouched") as err:
        ck.save()
    assert "\n" not in str(err.value)
    assert not step_folder(tmp_path / "checkpoints", 3).exists()  # the partial folder is gone, its space freed
    assert find_resume_folder("auto", tmp_path) == step_folder(tmp_path / "checkpoints", 2)
    assert older.is_dir()


def test_preflight_refuses_a_checkpoint_that_cannot_fit(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from zerotrain.checkpoint.manager import estimate_bytes, preflight_space

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
    needed = estimate_bytes(n_params=10**6, n_trainable=10**6, precision="fp32", backend="deepspeed")
    assert needed == 16 * 10**6  # 4 (weights) + 4 (fp32 master) + 8 (Adam moments) bytes per parameter
    with pytest.raises(UserError, match=r"--trainer.output_dir: .* has 976.6 KB free, one checkpoint needs about 15.3 MB"):
        preflight_space(tmp_path / "run", needed)
    preflight_space(tmp_path / "run", 10**5)  # fits: no error


# ---- the run's shape is recorded and checked ---------------------------------------------------------
def test_shape_is_recorded_and_a_different_micro_batch_is_refused(tmp_path):
    from zerotrain.checkpoint.manager import check_compatible

    shape = {"recipe": "toy", "backend": "deepspeed", "zero_stage": 2, "precision": "fp32", "micro_batch_size": 8,
             "grad_accum": 2, "world_size": 1}
    ck = Checkpointer(CheckpointConfig(), tmp_path, FakeEngine(), TrainState(), shape)
    folder = ck.save()
    meta = json.loads((folder / MARKER).read_text())
    assert {k: meta[k] for k in shape} == shape
    check_compatible(folder, shape)  # the same shape: no error
    with pytest.raises(UserError, match=r"written with micro_batch_size 8, this run has 4; pass --trainer.micro_batch_size 8"):
        check_compatible(folder, {**shape, "micro_batch_size": 4})
    with pytest.raises(UserError, match=r"written with zero_stage 2, this run has 3; pass --strategy.zero_stage 2"):
        check_compatible(folder, {**shape, "zero_stage": 3})
    with pytest.raises(UserError, match=r"written by deepspeed ZeRO-2, which this run \(ddp\) cannot load \(across "
                                         r"engines .*\); pass --strategy.backend deepspeed --strategy.zero_stage 2, "):
        check_compatible(folder, {**shape, "backend": "ddp", "zero_stage": None})


def test_weights_kept_in_another_dtype_are_refused(tmp_path):
    """ZeRO-0 bf16: the fast path keeps fp32 weights (autocast), DeepSpeed's bf16 block bf16 ones."""
    from zerotrain.checkpoint.manager import check_compatible

    folder = two_rank_checkpoint(tmp_path)
    meta = json.loads((folder / MARKER).read_text())
    (folder / MARKER).write_text(json.dumps({**meta, "weights_dtype": "bfloat16"}))
    now = {**SHAPE, "world_size": 2, "weights_dtype": "float32"}
    with pytest.raises(UserError, match=r"weights_dtype bfloat16, this run has float32; resume with the "
                                        r"--strategy.fast_path and --precision.dtype of the run that wrote it"):
        check_compatible(folder, now)
    check_compatible(folder, {**now, "weights_dtype": "bfloat16"})


def test_a_universal_cache_is_converted_again_when_the_checkpoint_beside_it_changed(tmp_path):
    """The cached universal checkpoint belongs to the checkpoint it was converted from: reused while that one's
    marker (every file with its size and checksum) is the same, converted again once another checkpoint of the
    same step has been copied over it, whose weights a resume would otherwise never read."""
    from zerotrain.checkpoint.layout import seal
    from zerotrain.checkpoint.universal import UNIVERSAL, _converted_once

    folder = tmp_path / "step00000004"
    folder.mkdir()

    def checkpoint(weights: float) -> None:
        torch.save({"w": torch.full((4,), weights)}, folder / "model.pt")
        files = seal(folder, 0, 1, True)
        (folder / MARKER).write_text(json.dumps({"format": 2, "world_size": 1, "step": 4, "files": files}))

    def convert(work: Path) -> None:  # what a converter writes: the source's weights in its own layout
        work.mkdir(parents=True)
        torch.save(torch.load(folder / "model.pt", weights_only=True)["w"], work / "fp32.pt")

    def cached() -> float:
        return float(torch.load(_converted_once(folder, True, convert, "a test") / "fp32.pt", weights_only=True)[0])

    checkpoint(1.0)
    assert cached() == 1.0
    before = (folder / UNIVERSAL / "fp32.pt").stat().st_mtime_ns
    assert cached() == 1.0 and (folder / UNIVERSAL / "fp32.pt").stat().st_mtime_ns == before  # reused
    checkpoint(2.0)
    assert cached() == 2.0
