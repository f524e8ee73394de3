"""The FSDP2 engine on CPU with Gloo: training the toy recipe and a tiny Hugging Face causal-lm, exact resume on
the same process count (bitwise, fp32), resume on another (DCP reshards), export, and its checkpoints read
without running code."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers import WORDS, Evil, toy_config, train_log, zerotrain_cmd

from zerotrain.checkpoint.export import export_run
from zerotrain.errors import UserError
from zerotrain.tasks.causal_lm import CausalLMConfig, CausalLMTask
from zerotrain.tasks.toy import ToyTask
from zerotrain.train.loop import fit

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0,
             pad_token_id=1, eos_token_id=2)
REL = 1e-5
"""A resume on another process count sums in another order: a few float32 ulps, carried by Adam over the steps
(see tests/checkpoint/test_reshard_resume.py); a wrong sample, rate or moment moves the loss by 1e-3 or more."""


@pytest.fixture()
def lm_files(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA))
    (tmp_path / "train.txt").write_text(
        "\n".join(" ".join(WORDS[(i * 7 + j * 3) % 12] for j in range(4 + i % 5)) for i in range(48)) + "\n")
    return tmp_path, tiny_tokenizer_dir


def lm_config(tmp_path: Path, tok: Path, run_name: str, steps: int, accumulation: int = 1) -> CausalLMConfig:
    cfg = CausalLMConfig()
    cfg.model.init, cfg.model.config, cfg.model.tokenizer = "random", str(tmp_path / "llama.json"), str(tok)
    cfg.data.train_path, cfg.data.val_path = str(tmp_path / "train.txt"), None
    cfg.data.seq_len, cfg.data.cache_dir = 32, str(tmp_path / "cache")
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.log_every_steps = 2, steps, 1
    cfg.trainer.num_workers, cfg.trainer.output_dir, cfg.trainer.run_name = 0, str(tmp_path), run_name
    cfg.trainer.evaluate = False
    cfg.logging.progress_bar, cfg.logging.tensorboard = False, False
    cfg.optimizer.lr = 1e-2
    cfg.precision.dtype = "fp32"
    cfg.checkpoint.every_steps = 3
    cfg.strategy.backend, cfg.strategy.gradient_accumulation_steps = "fsdp2", accumulation
    return cfg


def losses(run: Path) -> list[float]:
    log = train_log(run)
    return [log[s]["train_loss"] for s in sorted(log)]


def test_a_causal_lm_resumed_under_fsdp2_logs_bitwise_the_losses_of_one_that_never_stopped(lm_files):
    """Two Llama blocks and the root sharded, two micro-batches a step (the first without a gradient reduction):
    stopped at step 3 and resumed, every loss and the final weights are the uninterrupted run's, bit for bit;
    the checkpoint is DCP's, listed in the marker; export reads it back to the weights the run wrote."""
    from safetensors.torch import load_file

    tmp_path, tok = lm_files
    straight = fit(CausalLMTask(lm_config(tmp_path, tok, "straight", 6, accumulation=2)))
    fit(CausalLMTask(lm_config(tmp_path, tok, "split", 3, accumulation=2)))
    again = lm_config(tmp_path, tok, "split", 6, accumulation=2)
    again.checkpoint.resume = "auto"
    resumed = fit(CausalLMTask(again))

    a, b = losses(straight.run_dir), losses(resumed.run_dir)
    assert len(a) == 6 and b == a
    assert a[-1] < a[0]  # it trained
    step3 = tmp_path / "split" / "checkpoints" / "step00000003"
    marker = json.loads((step3 / "COMPLETE.json").read_text())
    assert marker["backend"] == "fsdp2" and marker["zero_stage"] is None
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "fsdp2_state.pt"} <= set(marker["files"])
    wa, wb = (load_file(r / "model" / "model.safetensors") for r in (straight.run_dir, resumed.run_dir))
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)

    out = export_run(resumed.run_dir, tmp_path / "exported")
    we = load_file(out.out_dir / "model" / "model.safetensors")
    assert sorted(we) == sorted(wb) and all(torch.equal(we[k], wb[k]) for k in wb)


def test_reading_a_checkpoint_tensor_by_tensor_parses_its_metadata_once(tmp_path, monkeypatch):
    """An export or a conversion reads one tensor at a time, and the ``.metadata`` (which grows with the tensors)
    is parsed once for all of them, again only when the file changes."""
    from zerotrain.checkpoint import dcp

    cfg = toy_config(tmp_path, "run", backend="fsdp2")
    cfg.trainer.max_steps = 1
    fit(ToyTask(cfg))
    folder = tmp_path / "run" / "checkpoints" / "step00000001"
    parsed = []
    real = dcp._MetadataUnpickler.load
    monkeypatch.setattr(dcp._MetadataUnpickler, "load", lambda self: parsed.append(1) or real(self))
    dcp._parsed_metadata.cache_clear()
    tensors = dcp.model_tensors(folder)
    assert len(tensors) > 1 and all(read().shape == shape for shape, _, read in tensors.values())
    assert len(parsed) == 1
    metadata = folder / dcp.FOLDER / dcp.METADATA
    metadata.write_bytes(metadata.read_bytes() + b"\n")  # another file: parsed again (and read as before)
    next(iter(tensors.values()))[2]()
    assert len(parsed) == 2


def test_a_dcp_metadata_file_replaced_by_one_of_the_same_size_and_time_is_parsed_again(tmp_path):
    """A checkpoint copied over another with its times kept (``cp -p``, ``rsync -t``, a rename over it) may match
    the old file's size and modification time: the new file's records are read, not the ones parsed before."""
    import os

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from zerotrain.checkpoint import dcp

    path, other = tmp_path / dcp.METADATA, tmp_path / "copy"
    path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={"aa": BytesStorageMetadata()})))
    other.write_bytes(pickle.dumps(Metadata(state_dict_metadata={"bb": BytesStorageMetadata()})))
    assert path.stat().st_size == other.stat().st_size
    assert list(dcp.read_metadata(path).state_dict_metadata) == ["aa"]
    times = path.stat()
    os.utime(other, ns=(times.st_atime_ns, times.st_mtime_ns))
    os.replace(other, path)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (times.st_size, times.st_mtime_ns)
    assert list(dcp.read_metadata(path).state_dict_metadata) == ["bb"]


def test_a_dcp_folder_that_is_a_file_ends_in_one_line(tmp_path):
    """A checkpoint whose ``dcp`` is a file, not a folder: one line naming the metadata path, not a traceback."""
    from zerotrain.checkpoint import dcp

    (tmp_path / dcp.FOLDER).write_text("not a folder")
    with pytest.raises(UserError, match=r"^--checkpoint\.resume: .*dcp/\.metadata cannot be loaded \(NotADirectoryError"):
        dcp.read_metadata(tmp_path / dcp.FOLDER / dcp.METADATA)


def test_a_crafted_dcp_metadata_file_is_refused_and_runs_nothing(tmp_path):
    """DCP's own reader would unpickle .metadata as it is. Replaced, with the marker rewritten to match (so the
    checksums do not catch it), the file is named in one line and what its pickle asks for never runs."""
    import hashlib

    cfg = toy_config(tmp_path, "run", backend="fsdp2")
    cfg.trainer.max_steps = 2
    run = fit(ToyTask(cfg)).run_dir
    folder = run / "checkpoints" / "step00000002"
    planted, metadata = tmp_path / "planted", folder / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(Evil(planted)))
    marker = json.loads((folder / "COMPLETE.json").read_text())
    marker["files"]["dcp/.metadata"] = {"bytes": metadata.stat().st_size,
                                        "sha256": hashlib.sha256(metadata.read_bytes()).hexdigest()}
    (folder / "COMPLETE.json").write_text(json.dumps(marker))
    with pytest.raises(UserError, match=r"dcp/\.metadata cannot be loaded: it names Python objects other than DCP's"):
        export_run(run, tmp_path / "out", step=2)
    resume = toy_config(tmp_path, "run", backend="fsdp2")
    resume.trainer.max_steps, resume.checkpoint.resume = 3, "auto"
    with pytest.raises(UserError, match=r"^--checkpoint\.resume: .*dcp/\.metadata cannot be loaded"):
        fit(ToyTask(resume))
    assert not planted.exists()


def test_a_shard_file_emptied_with_its_marker_rewritten_is_named_in_one_line_by_resume_and_export(tmp_path):
    """A ``.distcp`` file cut to nothing, its marker rewritten to match (the checksums pass): DCP's reader fails
    with a bare EOFError inside its report. Resume under fsdp2, resume under another engine (through the
    universal conversion) and export each end in one line naming the DCP folder."""
    import hashlib

    cfg = toy_config(tmp_path, "run", backend="fsdp2")
    cfg.trainer.max_steps = 2
    run = fit(ToyTask(cfg)).run_dir
    folder = run / "checkpoints" / "step00000002"
    shard = folder / "dcp" / "__0_0.distcp"
    shard.write_bytes(b"")
    marker = json.loads((folder / "COMPLETE.json").read_text())
    marker["files"]["dcp/__0_0.distcp"] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    (folder / "COMPLETE.json").write_text(json.dumps(marker))
    with pytest.raises(UserError, match=r"dcp cannot be loaded: it is damaged \(EOFError"):
        export_run(run, tmp_path / "out", step=2)
    for backend in ("fsdp2", "ddp"):
        resume = toy_config(tmp_path, "run", backend=backend)
        resume.trainer.max_steps, resume.checkpoint.resume = 3, "auto"
        with pytest.raises(UserError, match=r"^--checkpoint\.resume: .*step00000002/dcp cannot be loaded: it is damaged"):
            fit(ToyTask(resume))


@pytest.mark.slow
def test_two_processes_resumed_on_one_continue_the_uninterrupted_run(lm_files):
    """2 processes under FSDP2 for 3 steps of the causal-lm (its blocks sharded over both), then 1 process from
    their checkpoint: DCP gives the rank its new shards, accumulation 2 keeps the global batch, and the loss
    continues a 1-process run that never stopped."""
    tmp_path, tok = lm_files
    straight = fit(CausalLMTask(lm_config(tmp_path, tok, "straight", 6, accumulation=2)))
    out = zerotrain_cmd(["fit", "causal-lm", "--model.init", "random", "--model.config", str(tmp_path / "llama.json"),
                         "--model.tokenizer", str(tok), "--data.train_path", str(tmp_path / "train.txt"),
                         "--data.seq_len", "32", "--data.cache_dir", str(tmp_path / "cache"),
                         "--trainer.micro_batch_size", "2", "--trainer.evaluate", "false", "--optimizer.lr", "1e-2",
                         "--precision.dtype", "fp32", "--logging.tensorboard", "false", "--strategy.backend", "fsdp2",
                         "--trainer.max_steps", "3", "--trainer.log_every_steps", "1", "--trainer.num_workers", "0",
                         "--logging.progress_bar", "false", "--trainer.output_dir", str(tmp_path),
                         "--trainer.run_name", "split", "--launch.nproc_per_node", "2"], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "FSDP2 over 2 process(es), 2 blocks sharded one by one" in out.stdout + out.stderr
    ckpt = tmp_path / "split" / "checkpoints" / "step00000003"
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(json.loads((ckpt / "COMPLETE.json").read_text())["files"])
    # Rank 0 wrote the model, each tensor gathered from both ranks' shards as it was written: the checkpoint's weights
    from safetensors.torch import load_file

    finished = load_file(tmp_path / "split" / "model" / "model.safetensors")
    saved = load_file(export_run(tmp_path / "split", tmp_path / "exported").out_dir / "model" / "model.safetensors")
    assert sorted(finished) == sorted(saved) and all(torch.equal(finished[k], saved[k]) for k in saved)
    config = json.loads((tmp_path / "split" / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # not the class FSDP2 made of it

    again = lm_config(tmp_path, tok, "split", 6, accumulation=2)
    again.checkpoint.resume = "auto"
    resumed = fit(CausalLMTask(again))
    a, b = losses(straight.run_dir), losses(resumed.run_dir)
    assert len(a) == len(b) == 6
    assert b == pytest.approx(a, rel=REL)
    assert a[-1] != pytest.approx(a[0], rel=1e-2)  # it trained


def test_offload_and_reshard_settings_keep_the_numbers_and_bf16_keeps_fp32_master_weights(tmp_path):
    """Offloading to the host and keeping parameters gathered from forward to backward move memory, not results:
    their losses are the plain FSDP2 run's, bit for bit. bf16 computes in bf16 (other losses, close) and keeps the
    sharded master weights, which the checkpoint and the export hold, in fp32."""
    from safetensors.torch import load_file

    def run(name: str, **strategy) -> tuple[list[float], Path]:
        cfg = toy_config(tmp_path, name, backend="fsdp2", **strategy)
        cfg.trainer.max_steps = 3
        done = fit(ToyTask(cfg))
        return losses(done.run_dir), done.run_dir

    base, _ = run("base")
    assert run("offload", offload_optimizer="cpu")[0] == base
    assert run("gathered", reshard_after_forward=False)[0] == base
    bf16, bf16_run = run("bf16", precision="bf16")
    assert bf16 != base and bf16 == pytest.approx(base, rel=2e-2)
    assert {t.dtype for t in load_file(bf16_run / "model" / "model.safetensors").values()} == {torch.float32}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_resumes_under_fsdp2_and_the_loss_continues(tmp_path, stage):
    """DeepSpeed ZeRO-2 (or 3) for 4 steps, then FSDP2 from its checkpoint (converted once to DeepSpeed's universal
    checkpoint: every parameter's fp32 weights and Adam moments whole; ZeRO-3's flat, its step in the optimizer's
    file and its model-states file named otherwise): the schedule, the step and the loss continue the ZeRO run that
    never stopped (fp32; the two engines sum and clip in another order, a few ulps)."""
    def toy(name: str, steps: int, **strategy):
        cfg = toy_config(tmp_path, name, precision="fp32", **strategy)
        cfg.model.dropout, cfg.trainer.max_steps = 0.0, steps
        return cfg

    straight = fit(ToyTask(toy("straight", 8, zero_stage=stage)))
    fit(ToyTask(toy("split", 4, zero_stage=stage)))
    again = toy("split", 8, backend="fsdp2")
    again.checkpoint.resume = "auto"
    resumed = fit(ToyTask(again))

    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["lr"] == a[step]["lr"], f"step {step}: the schedule did not continue"
        assert b[step]["train_loss"] == pytest.approx(a[step]["train_loss"], rel=REL), f"step {step}"
    assert a[8]["train_loss"] != pytest.approx(a[1]["train_loss"], rel=1e-2)  # it trained
    step4 = tmp_path / "split" / "checkpoints" / "step00000004"
    assert (step4 / "universal" / "UNIVERSAL.json").is_file()  # the conversion, cached beside the checkpoint
    assert json.loads((tmp_path / "split" / "checkpoints" / "step00000008" / "COMPLETE.json").read_text())[
        "backend"] == "fsdp2"


def cross_toy(tmp_path: Path, name: str, steps: int, precision: str = "fp32", **strategy):
    """The toy recipe without dropout (a resume on another process count re-seeds it), fp32 unless named."""
    cfg = toy_config(tmp_path, name, precision=precision, **strategy)
    cfg.model.dropout, cfg.trainer.max_steps = 0.0, steps
    return cfg


def assert_continues(straight: dict, resumed: dict, steps: int, first: int = 1, rel: float = REL) -> None:
    """The resumed run's log rows (from step ``first``: a run folder of its own logs the steps it ran) are the
    uninterrupted run's: every step once, the same rate, the loss within ``rel``."""
    assert sorted(straight) == list(range(1, steps + 1)) and sorted(resumed) == list(range(first, steps + 1))
    for step in range(first, steps + 1):
        assert resumed[step]["lr"] == straight[step]["lr"], f"step {step}: the schedule did not continue"
        assert resumed[step]["train_loss"] == pytest.approx(straight[step]["train_loss"], rel=rel), f"step {step}"
    assert straight[steps]["train_loss"] != pytest.approx(straight[1]["train_loss"], rel=1e-2)  # it trained


def test_an_fsdp2_checkpoint_resumes_under_zero2_zero0_and_the_plain_engine_and_the_loss_continues(tmp_path):
    """FSDP2 for 4 steps, then DeepSpeed ZeRO-2, ZeRO-0 and the plain engine from its checkpoint (its DCP state
    written once as DeepSpeed's universal checkpoint: every parameter's fp32 weights, Adam moments and step whole;
    ZeRO-2 loads it with DeepSpeed's universal loader, ZeRO-0 and the plain engine set it through the module and the
    torch optimizer): the schedule, the step and the loss continue the FSDP2 run that never stopped. The later
    resumes reuse the conversion."""
    straight = train_log(fit(ToyTask(cross_toy(tmp_path, "straight", 8, backend="fsdp2"))).run_dir)
    fit(ToyTask(cross_toy(tmp_path, "split", 4, backend="fsdp2")))
    step4 = tmp_path / "split" / "checkpoints" / "step00000004"

    zero2 = cross_toy(tmp_path, "split", 8, zero_stage=2)
    zero2.checkpoint.resume = "auto"
    resumed = fit(ToyTask(zero2))
    assert_continues(straight, train_log(resumed.run_dir), 8)
    marker = step4 / "universal" / "UNIVERSAL.json"
    listed = json.loads(marker.read_text())["files"]
    assert {"zero/0.weight/fp32.pt", "zero/0.weight/exp_avg.pt", "zero/0.weight/exp_avg_sq.pt", "zero/0.weight/step.pt",
            "zero/optimizer_state.pt", "mp_rank_00_model_states.pt"} <= set(listed)
    assert json.loads((resumed.run_dir / "checkpoints" / "step00000008" / "COMPLETE.json").read_text())[
        "zero_stage"] == 2

    before = marker.stat().st_mtime_ns
    for name, strategy in (("zero0", {"zero_stage": 0}), ("plain", {"backend": "ddp"})):
        other = cross_toy(tmp_path, name, 8, **strategy)
        other.checkpoint.resume = str(step4)
        assert_continues(straight, train_log(fit(ToyTask(other)).run_dir), 8, first=5)
    assert marker.stat().st_mtime_ns == before  # converted once


def test_a_bf16_fsdp2_checkpoint_resumes_under_zero2_and_the_plain_engine(tmp_path):
    """In bf16 the crossing carries the fp32 master weights and moments FSDP2 keeps: ZeRO-2 (whose bf16 optimizer
    keeps fp32 masters too) continues the loss of the FSDP2 run that never stopped, and the plain engine (fp32
    weights under autocast) within bf16's rounding. ZeRO-0 in bf16 wraps its optimizer where the crossing cannot
    reach: one line naming the stages that load it."""
    straight = train_log(fit(ToyTask(cross_toy(tmp_path, "straight", 8, "bf16", backend="fsdp2"))).run_dir)
    fit(ToyTask(cross_toy(tmp_path, "split", 4, "bf16", backend="fsdp2")))
    step4 = tmp_path / "split" / "checkpoints" / "step00000004"
    for name, strategy, rel in (("zero2", {"zero_stage": 2}, REL), ("plain", {"backend": "ddp"}, 1e-3)):
        other = cross_toy(tmp_path, name, 8, "bf16", **strategy)
        other.checkpoint.resume = str(step4)
        assert_continues(straight, train_log(fit(ToyTask(other)).run_dir), 8, first=5, rel=rel)
    zero0 = cross_toy(tmp_path, "zero0", 8, "bf16", zero_stage=0)
    zero0.checkpoint.resume = str(step4)
    with pytest.raises(UserError, match=r"written by another engine.*--strategy.zero_stage 1, 2 or 3"):
        fit(ToyTask(zero0))


def test_an_fsdp2_checkpoint_of_another_model_is_refused_by_zero2_in_one_line(tmp_path):
    """A checkpoint copied alone (no hparams.json beside it to compare the model flags with) of a wider model: ZeRO-2
    refuses it naming the file and the sizes, as FSDP2 and the plain engine do, where DeepSpeed's universal loader
    would stop on an assertion."""
    import shutil

    cfg = cross_toy(tmp_path, "wide", 2, backend="fsdp2")
    cfg.checkpoint.every_steps = 2
    fit(ToyTask(cfg))
    alone = tmp_path / "copied" / "checkpoints" / "step00000002"
    alone.parent.mkdir(parents=True)
    shutil.copytree(tmp_path / "wide" / "checkpoints" / "step00000002", alone)
    narrow = cross_toy(tmp_path, "narrow", 4, zero_stage=2)
    narrow.model.width, narrow.checkpoint.resume = 16, str(alone)
    with pytest.raises(UserError, match=r"^--checkpoint\.resume: .*/universal/zero/0\.weight/fp32\.pt holds 256 values, "
                                        r"this model's 0\.weight has 128 \(was it written by another model\?\)\. "
                                        r"Resume it with its own model$"):
        fit(ToyTask(narrow))


def test_a_crossing_this_engine_cannot_load_is_refused_before_the_run_folder_is_rewritten(tmp_path):
    """A bf16 FSDP2 checkpoint resumed under DeepSpeed ZeRO-0 bf16 (whose optimizer DeepSpeed wraps, so the states
    cannot be set through it): one line naming the stages that can, and the run folder's records as they were."""
    cfg = toy_config(tmp_path, "bf16", precision="bf16", backend="fsdp2")
    cfg.trainer.max_steps = 2
    fit(ToyTask(cfg))
    recorded = {name: (tmp_path / "bf16" / name).read_bytes() for name in ("hparams.json", "metrics.jsonl")}
    zero0 = toy_config(tmp_path, "bf16", precision="bf16", zero_stage=0)
    zero0.trainer.max_steps, zero0.checkpoint.resume = 4, "auto"
    with pytest.raises(UserError, match=r"^--checkpoint\.resume: .*step00000002 was written by another engine, and "
                                        r"DeepSpeed ZeRO-0 bf16 keeps its optimizer in its own wrapper here: pass "
                                        r"--strategy\.zero_stage 1, 2 or 3$"):
        fit(ToyTask(zero0))
    assert {name: (tmp_path / "bf16" / name).read_bytes() for name in recorded} == recorded


@pytest.mark.slow
def test_two_fsdp2_processes_resume_on_one_under_zero3(tmp_path):
    """FSDP2 over 2 processes for 4 steps (each rank wrote half of every tensor), then 1 process under DeepSpeed
    ZeRO-3 (DeepSpeed's universal loader partitions what the conversion wrote whole): accumulation 2 keeps the global
    batch, and the loss continues a 1-process ZeRO-3 run that never stopped."""
    straight = fit(ToyTask(cross_toy(tmp_path, "straight", 8, zero_stage=3, gradient_accumulation_steps=2)))
    out = zerotrain_cmd(["fit", "toy", "--data.num_examples", "48", "--trainer.micro_batch_size", "8",
                         "--strategy.gradient_accumulation_steps", "1", "--scheduler.name", "step",
                         "--scheduler.step_unit", "steps", "--scheduler.step_size", "3", "--scheduler.gamma", "0.5",
                         "--optimizer.lr", "1e-2", "--precision.dtype", "fp32", "--model.dropout", "0",
                         "--strategy.backend", "fsdp2", "--trainer.max_steps", "4", "--trainer.log_every_steps", "1",
                         "--trainer.num_workers", "0", "--logging.progress_bar", "false",
                         "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "split",
                         "--launch.nproc_per_node", "2"], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    step4 = tmp_path / "split" / "checkpoints" / "step00000004"
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(json.loads((step4 / "COMPLETE.json").read_text())["files"])

    a = train_log(straight.run_dir)
    zero3 = cross_toy(tmp_path, "split", 8, zero_stage=3)
    zero3.checkpoint.resume = "auto"
    assert_continues(a, train_log(fit(ToyTask(zero3)).run_dir), 8)


def test_crossings_no_engine_can_load_are_refused_in_one_line_naming_the_flags(tmp_path):
    """FSDP2 -> DeepSpeed (any stage) and the plain engine are admitted, as ZeRO-1/2/3 -> FSDP2; the rest (ZeRO-0 or
    the plain engine -> FSDP2) end in one line that names the crossings and the flags that resume the checkpoint."""
    from zerotrain.checkpoint.manager import check_compatible, crosses_engines

    shape = {"recipe": "toy", "precision": "fp32", "weights_dtype": "float32", "micro_batch_size": 8, "grad_accum": 2,
             "world_size": 1}
    fsdp2 = {**shape, "backend": "fsdp2", "zero_stage": None}
    for stage in (0, 1, 2, 3):
        assert crosses_engines(fsdp2, {**shape, "backend": "deepspeed", "zero_stage": stage})
    assert crosses_engines(fsdp2, {**shape, "backend": "ddp", "zero_stage": None})
    assert crosses_engines({**shape, "backend": "deepspeed", "zero_stage": 2}, fsdp2)

    folder = tmp_path / "step00000004"
    folder.mkdir()
    for saved, flags in (({"backend": "deepspeed", "zero_stage": 0}, "--strategy.backend deepspeed --strategy.zero_stage 0"),
                         ({"backend": "ddp", "zero_stage": None}, "--strategy.backend ddp")):
        (folder / "COMPLETE.json").write_text(json.dumps({"format": 2, **shape, **saved, "files": {}}))
        with pytest.raises(UserError, match=r"^--checkpoint\.resume: .* cannot load \(across engines zerotrain resumes "
                                            r"ZeRO-1/2/3 -> fsdp2, fsdp2 -> deepspeed \(ZeRO-0/1/2/3\) or ddp\); pass "
                                            + flags + ", or start a new run") as err:
            check_compatible(folder, fsdp2)
        assert "\n" not in str(err.value)
    (folder / "COMPLETE.json").write_text(json.dumps({"format": 2, **fsdp2, "files": {}}))
    check_compatible(folder, {**shape, "backend": "deepspeed", "zero_stage": 3})  # admitted: no error


def test_auto_precision_that_is_fp16_on_this_gpu_is_refused_by_fsdp2_in_one_line(tmp_path):
    """``--precision.dtype auto`` is fp16 on a GPU without bf16; the config refuses fp16 with fsdp2 only when it is
    written, so the engine is built with the resolved precision and must refuse it: it would otherwise compute in
    fp32, record fp16, and resume a ZeRO fp16 checkpoint without its loss scale. In a group of one process (Gloo),
    where the engine would otherwise be built."""
    import torch.distributed as dist

    from zerotrain.engines.build import build_engine
    from zerotrain.errors import ConfigError

    cfg = toy_config(tmp_path, "auto16", backend="fsdp2")
    assert cfg.precision.dtype == "auto"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"^--precision\.dtype auto is fp16 on this GPU \(it has no bf16\), "
                                              r"which --strategy\.backend fsdp2 does not offer .*: pass "
                                              r"--precision\.dtype fp32, or --strategy\.backend deepspeed or ddp$"):
            build_engine(torch.nn.Linear(4, 4), cfg, torch.device("cpu"), "fp16", 8, 8, 1)
    finally:
        dist.destroy_process_group()


def test_metadata_written_by_python_3_13_names_pathlib_by_its_private_module_and_is_read():
    """Python 3.13 pickles ``PosixPath`` as ``pathlib._local.PosixPath``; DCP's ``.metadata`` holds one."""
    import io

    from zerotrain.checkpoint.dcp import _MetadataUnpickler

    written = pickle.dumps(Path("/runs/x"), protocol=0).replace(b"cpathlib\nPosixPath", b"cpathlib._local\nPosixPath")
    assert b"pathlib._local" in written
    assert _MetadataUnpickler(io.BytesIO(written)).load() == Path("/runs/x")
    evil = pickle.dumps(Path("/x"), protocol=0).replace(b"cpathlib\nPosixPath", b"cpathlib._local\nos")
    with pytest.raises(pickle.UnpicklingError, match="pathlib.os"):  # the private module admits nothing more
        _MetadataUnpickler(io.BytesIO(evil)).load()


def test_a_failed_dcp_write_raises_the_rank_s_own_error(tmp_path, monkeypatch):
    """DCP wraps a failed write in CheckpointException (a BaseException): the caller gets the OSError back, which
    the checkpoint code turns into its one line (a full disk)."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from zerotrain.checkpoint import dcp

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(OSError, match="No space left"):
        dcp.save({"model": {"w": torch.zeros(3)}}, tmp_path)
