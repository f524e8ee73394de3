"""Checks that need a CUDA GPU. Run on the GPU machine: ``pytest -m gpu``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import popen_zerotrain, train_log, wait_for_rows, zerotrain_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # most tests start a `python -m zerotrain fit` process


def _fit(tmp_path: Path, *flags: str, env_extra: dict[str, str] | None = None) :
    return zerotrain_cmd(["fit", "toy", "--trainer.max_steps", "6", "--trainer.num_workers", "0",
                          "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "gpu",
                          "--logging.progress_bar", "false", *flags], cwd=tmp_path, timeout=900, **(env_extra or {}))


def test_hopper_arch_list_does_not_break_the_op_build(tmp_path):
    """TORCH_CUDA_ARCH_LIST=9.0a (set by Hopper images) must not reach DeepSpeed's parser: FusedAdam builds."""
    out = _fit(tmp_path, "--strategy.zero_stage", "1", "--precision.dtype", "bf16",
               env_extra={"TORCH_CUDA_ARCH_LIST": "9.0a"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "invalid literal for int()" not in out.stderr
    ds = json.loads((tmp_path / "gpu" / "ds_config.json").read_text())
    assert ds["optimizer"]["params"]["torch_adam"] is False  # the fused CUDA kernel, not torch's Adam


@pytest.fixture
def flags(request) -> tuple[str, ...]:
    """The strategy's flags; with CPU offload, DeepSpeed's CPU Adam op is built first, in the setup (conftest)."""
    if "--strategy.offload_optimizer" in request.param:
        request.getfixturevalue("cpu_adam_built")
    return request.param


@pytest.mark.parametrize("flags", [
    ("--strategy.zero_stage", "3"),
    ("--strategy.zero_stage", "2", "--strategy.offload_optimizer", "cpu"),
    ("--strategy.backend", "ddp"),
], indirect=True)
def test_each_strategy_trains_in_bf16(tmp_path, flags):
    out = _fit(tmp_path, "--precision.dtype", "bf16", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["gpu_mem_peak_gib"] > 0


def test_an_offloaded_run_steps_on_every_cpu_thread_with_pinning_loader_workers(tmp_path, cpu_adam_built):
    """CPU Adam runs on the training thread's CPU threads; loader workers that pin memory must leave them at
    PyTorch's default (the count a fresh process has), not the pin-memory thread's one."""
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                             text=True, check=True)
    out = zerotrain_cmd(["fit", "toy", "--trainer.max_steps", "3", "--trainer.num_workers", "2",
                         "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "gpu",
                         "--logging.progress_bar", "false", "--precision.dtype", "bf16",
                         "--strategy.zero_stage", "2", "--strategy.offload_optimizer", "cpu"], cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    env = json.loads((tmp_path / "gpu" / "env.json").read_text())
    assert env["cpu_threads"] == int(default.stdout) > 1


def test_fp16_reports_the_loss_scale(tmp_path):
    out = _fit(tmp_path, "--precision.dtype", "fp16", "--strategy.zero_stage", "2",
               "--trainer.log_every_steps", "1", "--precision.initial_scale_power", "12")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in rows if "loss_scale" in r]
    assert scales and all(s <= 2**12 for s in scales)


def test_zero0_bf16_runs_the_autocast_fast_path(tmp_path):
    """ZeRO-0 in bf16 trains through torch_autocast with the engine's own clip: the grad norm is logged."""
    out = _fit(tmp_path, "--precision.dtype", "bf16", "--strategy.zero_stage", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    ds = json.loads((tmp_path / "gpu" / "ds_config.json").read_text())
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and ds["bf16"]["enabled"] is False
    rows = [json.loads(line) for line in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in rows if "train_loss" in r]
    assert norms and all(n > 0 for n in norms)
    assert json.loads((tmp_path / "gpu" / "summary.json").read_text())["precision"] == "bf16"


def test_sigterm_saves_and_the_zero2_bf16_checkpoint_resumes_on_gpu(tmp_path):
    """Pre-emption of a one-process GPU run (alone, no collective decides; the NCCL agreement of several
    ranks is not covered here), then DeepSpeed's checkpoint files of a bf16 ZeRO-2 run go through the
    weights-only loader with GPU tensors in them."""
    import signal

    from zerotrain.checkpoint.layout import MARKER, complete_checkpoints
    from zerotrain.runtime.preemption import PREEMPTED_EXIT

    args = ["fit", "toy", "--trainer.max_steps", "100000", "--trainer.log_every_steps", "1", "--trainer.num_workers",
            "0", "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "run", "--logging.progress_bar", "false",
            "--trainer.eval_every_steps", "100000", "--strategy.zero_stage", "2", "--precision.dtype", "bf16"]
    proc = popen_zerotrain(args, tmp_path)
    wait_for_rows(tmp_path / "run" / "metrics.jsonl", proc, timeout=600)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    (folder,) = complete_checkpoints(tmp_path / "run" / "checkpoints")
    step = json.loads((folder / MARKER).read_text())["step"]
    resumed = popen_zerotrain([*args[:3], str(step + 2), *args[4:], "--checkpoint.resume", "auto"], tmp_path)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_step"] == step + 2


def test_gpu_memory_cap_holds_on_an_unindexed_device():
    """--trainer.gpu_memory_gib: the probe passes torch.device("cuda"), which has no index."""
    import torch

    from zerotrain.runtime.distributed import cap_gpu_memory

    torch.cuda.empty_cache()  # a cached block would serve the allocation below without asking the cap
    try:
        assert cap_gpu_memory(torch.device("cuda"), 1.0) == 2**30
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_probe_measures_the_workspace_a_step_keeps_on_the_gpu():
    """cuBLAS keeps a workspace per stream and thread (forward, and autograd's backward thread): the
    probe reports it beyond the weights and gradients, so predictions count it."""
    import torch
    from torch import nn

    from zerotrain.plan.probe import _held_beyond_model

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 8)).to(device)
    before = _held_beyond_model(model, device)
    model(torch.randn(64, 1024, device=device)).square().mean().backward()
    held = _held_beyond_model(model, device)
    assert held > before and held < 1024**3
    # The gradients (4.2 MB) are not part of it: freeing them leaves the figure as it was, but for the
    # allocator's rounding of each block to 512 bytes.
    model.zero_grad(set_to_none=True)
    assert _held_beyond_model(model, device) == pytest.approx(held, abs=64 * 1024)


@pytest.mark.parametrize("stage", ["0", "2"])
def test_cuda_graphs_train_as_the_compiled_model_does(tmp_path, stage):
    """--compile.mode reduce-overhead replays the same kernels as CUDA graphs: with dropout off, the
    loss curve is the default mode's, step by step (ZeRO-2 takes each gradient from the graph's pool in a hook)."""
    curves = {}
    for mode in ("default", "reduce-overhead"):
        (tmp_path / mode).mkdir()
        out = _fit(tmp_path / mode, "--strategy.zero_stage", stage, "--precision.dtype", "fp32",
                   "--model.dropout", "0", "--compile.enabled", "true", "--compile.mode", mode,
                   "--trainer.max_steps", "12", "--trainer.log_every_steps", "1",
                   env_extra={"TORCH_LOGS": "perf_hints"})  # inductor says there why it would skip the graphs
        assert out.returncode == 0, out.stderr[-3000:]
        log = out.stdout + out.stderr
        assert f"(mode {mode})" in log and "skipping cudagraphs" not in log, log[-3000:]
        rows = [json.loads(line) for line in (tmp_path / mode / "gpu" / "metrics.jsonl").read_text().splitlines()]
        curves[mode] = [r["train_loss"] for r in rows if "train_loss" in r]
    assert len(curves["default"]) == 12
    # Each step's loss is on new random batches: a graph replaying stale weights would drift from step 2 on
    assert curves["reduce-overhead"] == pytest.approx(curves["default"], rel=1e-4)


def test_an_mlm_training_step_never_waits_for_the_gpu(tmp_path, tiny_tokenizer_dir):
    """The pipeline hands the step its masked positions: forward, loss and backward make no host-device
    synchronisation (torch raises on one in sync-debug "error" mode). The head finding the positions
    itself would."""
    import torch

    from zerotrain.config import TrainerConfig
    from zerotrain.engines.base import to_device
    from zerotrain.tasks.mlm import MLMConfig, MLMDataConfig, MLMModelConfig, MLMTask

    (tmp_path / "train.txt").write_text("the movie was great and i loved the plot but the acting was bad\n" * 40)
    cfg = MLMConfig(model=MLMModelConfig(num_layers=2, num_heads=2, h_dim=32, ff_dim=64, max_seq_length=32),
                    data=MLMDataConfig(train_path=str(tmp_path / "train.txt"), tokenizer=str(tiny_tokenizer_dir),
                                       cache_dir=str(tmp_path / "cache")),
                    trainer=TrainerConfig(max_steps=1, micro_batch_size=4)).validate()
    task = MLMTask(cfg)
    train = task.build_datasets().train
    host = task.collator()([train[i] for i in range(4)])
    batch = to_device({k: v.pin_memory() for k, v in host.items()}, torch.device("cuda"))
    model = task.build_model().cuda().train()
    task.training_step(model, batch).loss.backward()  # warm-up: first calls may allocate and sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        task.training_step(model, batch).loss.backward()
        with pytest.raises(RuntimeError, match="synchroniz"):
            model(input_ids=batch["input_ids"], labels=batch["labels"])  # the head's own nonzero
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("stage, fast_path", [("1", "true"), ("2", "true"), ("1", "false")])
def test_a_zero12_bf16_step_never_waits_for_the_gpu(tmp_path, monkeypatch, stage, fast_path):
    """DeepSpeed ZeRO-1/2's whole step, clip included, runs in torch's sync-debug "error" mode once the
    first two steps (which allocate) are done: zerotrain.engines.ds_private.zero_clip leaves DeepSpeed no host-device wait.
    Without the fast path DeepSpeed's own clip and norm mask wait, and the mode raises. In-process, so the mode wraps
    the engine's step alone (log steps read the loss outside it)."""
    import torch

    from zerotrain.cli import main
    from zerotrain.engines.base import Engine
    from zerotrain.runtime.launcher import TORCHRUN_VARIABLES

    for name in TORCHRUN_VARIABLES:  # the single-process group sets them: gone again after the test
        monkeypatch.delenv(name, raising=False)
    step, calls, strict = Engine.train_step, [], []

    def train_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:  # warm-up
            return step(self, *args, **kwargs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        strict.append(1)
        return out

    monkeypatch.setattr(Engine, "train_step", train_step)
    argv = ["fit", "toy", "--trainer.max_steps", "6", "--trainer.num_workers", "0", "--trainer.output_dir",
            str(tmp_path), "--trainer.run_name", "gpu", "--logging.progress_bar", "false", "--precision.dtype",
            "bf16", "--strategy.zero_stage", stage, "--strategy.gradient_clipping", "1.0",
            "--strategy.fast_path", fast_path]
    if fast_path == "false":
        with pytest.raises(RuntimeError, match="synchroniz"):
            main(argv)
        return
    assert main(argv) == 0 and len(strict) == 4


def test_the_mlm_residual_stream_is_bf16_under_cuda_autocast():
    """CUDA autocast returns layer_norm in float32; the MLM's LayerNorm hands its layers bf16 instead, rounded once."""
    import torch

    from zerotrain.models.roberta_mlm import LayerNorm, RobertaMLM

    torch.manual_seed(0)
    model = RobertaMLM(vocab_size=64, num_layers=2, num_heads=2, h_dim=32, ff_dim=64, dropout=0.0,
                       max_seq_length=16, pad_token_id=1).cuda()
    seen = []
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    ln, x = model.encoder.layers[0].ln_ff, torch.randn(4, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch_out = torch.nn.LayerNorm.forward(ln, x)
        ours = ln(x)
        model(torch.randint(3, 64, (2, 16), device="cuda"))["logits"].float().sum().backward()
    assert isinstance(ln, LayerNorm) and torch_out.dtype == torch.float32
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, torch_out.bfloat16())
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_the_backward_clock_finds_autograds_thread_for_the_gpu_and_it_runs():
    """A CUDA backward runs on torch's pt_autograd_<index> thread: the clock finds the thread by that name and its
    CPU time grows with backward work (no such clock on a CPU device: tests/metrics/test_metrics.py)."""
    import torch

    from zerotrain.metrics.meters import BackwardThreadClock, HostClock

    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    (x @ x).sum().backward()  # the first backward starts autograd's device threads
    clock = BackwardThreadClock(torch.device("cuda"))
    start = HostClock.read(backward=clock)
    for _ in range(200):
        (x @ x).relu().sum().backward()
    torch.cuda.synchronize()
    assert start.backward_cpu_s is not None
    assert (HostClock.read(backward=clock) - start).backward_cpu_s > 0


def _tiny_lm(tmp_path: Path, run: str, *flags: str) -> subprocess.CompletedProcess:
    """The shipped tiny causal-lm config on the GPU, checkpointed every 3 steps."""
    from conftest import REPO

    return zerotrain_cmd(["fit", "causal-lm", "--config", str(REPO / "configs" / "causal_lm_tiny.yaml"),
                          "--model.config", str(REPO / "configs" / "tiny_llama_config.json"),
                          "--model.tokenizer", str(REPO / "examples" / "data" / "roberta-tokenizer"),
                          "--data.train_path", str(REPO / "examples" / "data" / "imdb-sample" / "train.jsonl.gz"),
                          "--data.cache_dir", str(tmp_path / "cache"), "--trainer.log_every_steps", "1",
                          "--checkpoint.every_steps", "3", "--trainer.output_dir", str(tmp_path),
                          "--trainer.run_name", run, "--logging.progress_bar", "false", *flags],
                         cwd=tmp_path, timeout=900)


def test_causal_lm_packed_documents_take_flex_attention_and_train(tmp_path):
    """On a GPU, document-masked packed rows take flex_attention by default (sdpa would get a dense mask), and the
    compiled model trains with it: the loss falls."""
    out = _tiny_lm(tmp_path, "flex", "--precision.dtype", "bf16", "--compile.enabled", "true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "attn_implementation=flex_attention" in out.stderr + out.stdout
    rows = [json.loads(line) for line in (tmp_path / "flex" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert len(losses) >= 3 and losses[-1] < losses[0]


FSDP2 = ("--strategy.backend", "fsdp2", "--strategy.zero_stage", "0")  # the tiny config's stage 2 is DeepSpeed's
FSDP2_VARIANTS = {
    "resharded": (),
    "kept_after_forward": ("--strategy.reshard_after_forward", "false"),
    "offloaded": ("--strategy.offload_optimizer", "cpu", "--strategy.offload_param", "cpu"),
    "compiled": ("--compile.enabled", "true"),
    "checkpointed_activations": ("--activation_checkpointing.enabled", "true"),
}


@pytest.mark.parametrize("variant", sorted(FSDP2_VARIANTS))
def test_fsdp2_trains_a_causal_lm_on_the_gpu_in_bf16(tmp_path, variant):
    """fully_shard per block and on the root under NCCL, bf16 compute over fp32 master weights, in each of the
    engine's settings: the loss falls and the run reports bf16 and its GPU peak."""
    out = _tiny_lm(tmp_path, "run", *FSDP2, "--precision.dtype", "bf16",
                   "--trainer.max_steps", "12", *FSDP2_VARIANTS[variant])
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["gpu_mem_peak_gib"] > 0
    log = train_log(tmp_path / "run")
    assert len(log) == 12 and log[12]["train_loss"] < log[1]["train_loss"]


def test_an_fsdp2_run_resumed_on_the_gpu_continues_the_uninterrupted_run(tmp_path):
    """Stopped at step 3 and resumed from its DCP checkpoint, an fp32 FSDP2 run on the GPU logs the uninterrupted
    run's losses (to 1e-4: cuBLAS and the embedding's backward may sum in another order between processes)."""
    straight = _tiny_lm(tmp_path, "straight", *FSDP2, "--trainer.max_steps", "6")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = _tiny_lm(tmp_path, "split", *FSDP2, "--trainer.max_steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _tiny_lm(tmp_path, "split", *FSDP2, "--trainer.max_steps", "6", "--checkpoint.resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = train_log(tmp_path / "straight"), train_log(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert all(b[s]["train_loss"] == pytest.approx(a[s]["train_loss"], rel=1e-4) for s in a)
    assert a[6]["train_loss"] < a[1]["train_loss"]
