"""The memory model's FSDP2 figures against what the FSDP2 engine holds on the CPU with Gloo.

The measurement is PyTorch's own count of live tensor storages (``MemTracker``, what the probe uses on the CPU)
over the engine's second training step (the first creates Adam's states): its peak, from the sharded parameters,
gradients and states through the gathered bf16 or fp32 copies and the reduce-scatter buffers. The prediction is
:func:`~zerotrain.engines.states.model_state_memory` at the step's three moments
(:func:`~zerotrain.plan.memory.step_peak`) with the activations of the same model unsharded, measured the same way.
The model is four wide blocks and a root group (embeddings and head), so that the blocks, the root and the sharded
states are each a sizeable share of the peak: leaving out the gathered copies, counting them in fp32 under bf16, or
holding the whole model gathered under ``reshard_after_forward`` true each moves a prediction by more than 10%.

Not measured here: the unsharded gradients kept across the micro-batches of a step (``MemTracker`` counts one
forward pass per module and tracking), what a GPU adds (the block its all-gather stream prefetches, the caching allocator's rounding)
and the host side of CPU offload (it needs a device to offload from).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.engines.states import Strategy, count_params, model_state_memory
from zerotrain.plan.memory import step_peak
from zerotrain.tasks.base import StepOutput

WIDTH, BLOCKS = 256, 4
TOLERANCE = 0.10


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, d: int = WIDTH, n: int = BLOCKS):
        super().__init__()
        self.embed, self.head = nn.Linear(d, d), nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _step(model: nn.Module, batch: dict) -> StepOutput:
    return StepOutput(loss=model(batch["x"]).float().pow(2).mean(), tokens=2, samples=2)


def _tracked_peak(run, *external) -> float:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*external)
    with tracker:
        run()
        return float(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _activation_bytes(precision: str) -> float:
    """The forward pass's peak above the weights, on the model unsharded in its compute dtype."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = Stack().to(torch.bfloat16 if precision == "bf16" else torch.float32)
    x = torch.randn(2, WIDTH, dtype=next(model.parameters()).dtype)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        base = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        model(x).float().pow(2).mean()
        return float(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base)


def measured_and_predicted(precision: str, reshard: bool, accumulation: int) -> tuple[float, float]:
    """(measured peak, predicted peak) of one process of the current process group."""
    from zerotrain.engines.fsdp2 import FSDP2Engine

    torch.manual_seed(0)
    model = Stack()
    counts = count_params(model)
    cfg = RunConfig()
    cfg.strategy.backend, cfg.strategy.reshard_after_forward = "fsdp2", reshard
    cfg.strategy.gradient_accumulation_steps, cfg.trainer.max_steps = accumulation, 4
    engine = FSDP2Engine(model, cfg, torch.device("cpu"), precision, total_steps=4, steps_per_epoch=4)  # type: ignore[arg-type]
    batches = [{"x": torch.randn(2, WIDTH)} for _ in range(accumulation)]
    engine.train_step(batches, _step)  # Adam's states exist from here on
    peak = _tracked_peak(lambda: engine.train_step(batches, _step), engine.module, engine.optimizer)
    states = model_state_memory(counts, Strategy("fsdp2", reshard_after_forward=reshard), dist.get_world_size(),
                                precision, grad_accum=accumulation, device="cpu")
    act = _activation_bytes(precision)
    return peak, step_peak(states, act, act, accumulation)


CASES = [(p, r) for p in ("fp32", "bf16") for r in (True, False)]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        rows = [(p, r, *measured_and_predicted(p, r, 1)) for p, r in CASES]
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def _check(rows) -> None:
    off = {(p, r): predicted / peak - 1 for p, r, peak, predicted in rows}
    assert all(abs(x) <= TOLERANCE for x in off.values()), off


def test_one_process_peaks_are_predicted_within_ten_percent(tmp_path):
    """1 process, fp32 and bf16, both reshard settings: the peak of the engine's step within 10% of the prediction."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of several processes is already up in this test process")
    try:
        rows = [(p, r, *measured_and_predicted(p, r, 1)) for p, r in CASES]
    finally:
        if own:
            dist.destroy_process_group()
    _check(rows)


@pytest.mark.slow  # starts two processes
def test_two_process_peaks_are_predicted_within_ten_percent(tmp_path, monkeypatch):
    """2 processes on Gloo: each holds half of every sharded state and the same gathered copies."""
    import torch.multiprocessing as mp

    out = tmp_path / "rows.pt"
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # for the children only
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    rows = torch.load(out)
    assert len(rows) == len(CASES)
    _check(rows)


def test_reshard_after_forward_false_holds_the_whole_model_gathered_at_the_forwards_end():
    """What separates the two settings in the model: the whole model's compute copies at the forward's end
    (bf16: 2 bytes a parameter), released in the backward pass as the gradients come in."""
    counts = count_params(Stack())
    keep = model_state_memory(counts, Strategy("fsdp2", reshard_after_forward=False), 2, "bf16", device="cpu")
    free = model_state_memory(counts, Strategy("fsdp2"), 2, "bf16", device="cpu")
    assert keep.gpu_bytes - free.gpu_bytes == keep.gathered_bytes > 0
    root = counts.total - counts.in_blocks
    assert keep.gathered_bytes == 2 * (counts.total - root - counts.largest_block)
    # sharded fp32 weights and two Adam states, halved, under both
    assert free.gpu_bytes - free.transient_bytes == 12 * counts.total // 2 + 2 * (root + counts.largest_block)


def test_estimate_lists_the_fsdp2_rows_beside_zero_and_sizes_the_offload_on_the_host(capsys):
    """``zerotrain estimate`` shows fsdp2, fsdp2_no_reshard and fsdp2_offload after DeepSpeed's rows: on 2 GPUs
    the offload keeps only gathered copies on the GPU and its sharded states on the host, pinned (twice their
    bytes at most) unless --strategy.offload_pin_memory false."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report
    from zerotrain.plan.strategies import STRATEGIES

    cfg = parse_config("toy", ["--launch.nproc_per_node", "2"])
    report = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64)
    names = [row.name for row in report.rows]
    assert names[-3:] == ["fsdp2", "fsdp2_no_reshard", "fsdp2_offload"] and "zero3" in names
    rows = {row.name: row.memory for row in report.rows}
    c = report.counts
    sharded = (4 + 4 + 8) * c.total // 2  # bf16 run, the toy built in fp32: weights, gradients, Adam
    assert rows["fsdp2_offload"].cpu_bytes == pytest.approx(2 * 8 * c.total / 2 + 8 * c.total / 2, abs=2)
    assert rows["fsdp2_offload"].gpu_bytes < rows["fsdp2"].gpu_bytes - sharded + 2 * c.total
    assert rows["fsdp2"].gpu_bytes >= sharded and rows["fsdp2_no_reshard"].gpu_bytes >= rows["fsdp2"].gpu_bytes
    text = format_report(report)
    assert "| fsdp2 |" in text and "| fsdp2_offload |" in text and "| zero2 |" in text
    unpinned = parse_config("toy", ["--launch.nproc_per_node", "2", "--strategy.offload_pin_memory", "false"])
    halved = {r.name: r.memory for r in estimate("toy", unpinned, gpu_memory_gib=16, host_memory_gib=64).rows}
    assert halved["fsdp2_offload"].cpu_bytes == pytest.approx(16 * c.total / 2, abs=2)
    assert STRATEGIES["fsdp2_no_reshard"].family == "FSDP2" and STRATEGIES["zero2"].family == "DeepSpeed ZeRO"


def test_fsdp2_strategy_flags_select_what_they_name():
    """Each FSDP2 strategy's flags parse to a valid fsdp2 config with its reshard and offload settings."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.strategies import STRATEGIES

    for name in ("fsdp2", "fsdp2_no_reshard", "fsdp2_offload"):
        cfg = parse_config("toy", [*STRATEGIES[name].flags(), "--trainer.max_steps", "1"])
        cfg.validate()
        s = cfg.strategy
        assert s.backend == "fsdp2" and s.reshard_after_forward is (name != "fsdp2_no_reshard")
        assert (s.offload_optimizer == "cpu") is (name == "fsdp2_offload")
        assert STRATEGIES[name].apply(parse_config("toy", ["--strategy.reshard_after_forward", "false"])
                                      ).strategy.reshard_after_forward is (name != "fsdp2_no_reshard")


def test_the_planner_offers_fsdp2_only_where_auto_precision_is_not_fp16():
    """``--precision.dtype auto`` is fp16 on a GPU without bf16, which the FSDP2 engine refuses: the planner, given
    the probe's resolved precision, offers no FSDP2 candidate there, and offers them where auto is bf16."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.planner import candidates

    cfg = parse_config("toy", ["--trainer.max_steps", "1"])
    assert cfg.precision.dtype == "auto"
    on = {c.strategy for c in candidates(cfg, "cuda", precision="bf16")}
    off = {c.strategy for c in candidates(cfg, "cuda", precision="fp16")}
    assert {"fsdp2", "fsdp2_no_reshard", "fsdp2_offload"} <= on
    assert not any(name.startswith("fsdp2") for name in off) and "zero2" in off


def test_fsdp2_speed_charges_two_all_gathers_when_resharding_and_the_host_when_offloaded():
    from helpers import fake_probe

    from zerotrain.engines.states import ParamCounts
    from zerotrain.plan.speed import step_time
    from zerotrain.plan.strategies import STRATEGIES

    counts = ParamCounts(total=10**8, trainable=10**8, largest_layer=10**6, total_bytes=4 * 10**8,
                         trainable_bytes=4 * 10**8, tensors=200, largest_block=10**7, in_blocks=9 * 10**7)
    probe = fake_probe()

    def time(name: str, world: int):
        return step_time(STRATEGIES[name], 8, 1, False, counts, probe, world, 1, autocast=False)

    assert time("fsdp2", 1).communication == 0.0
    two, kept = time("fsdp2", 2), time("fsdp2_no_reshard", 2)
    # bf16 on a GPU: the reduce-scatter of the gradients and two all-gathers of the parameters, or one
    assert two.communication / kept.communication == pytest.approx(3 / 2)
    assert time("fsdp2_offload", 2).optimizer > two.optimizer
    assert two.optimizer == pytest.approx(probe.optimizer_step_s / 2)


@pytest.mark.slow  # the probe and each trial are processes of their own
def test_plan_on_the_cpu_lists_fsdp2_rows_beside_zero_ones(tmp_path):
    """``zerotrain plan`` with ZeRO-2 and both FSDP2 settings: each is assessed, trialled as a short fit at the
    configured micro-batch (``--compare_strategies``), and shown in plan.md with its family; the choice is the
    fastest trial, whichever family."""
    import json

    from helpers import zerotrain_cmd

    out = tmp_path / "plan"
    r = zerotrain_cmd(["plan", "toy", "--trainer.num_workers", "0", "--trainer.micro_batch_size", "16",
                       "--trainer.max_steps", "6", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
                       "--trainer.output_dir", str(tmp_path / "runs"), "--out", str(out),
                       "--strategies", "zero2,fsdp2,fsdp2_no_reshard", "--trials", "1", "--trial_steps", "3",
                       "--trial_seconds", "0.5", "--compare_strategies"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "plan.json").read_text())
    tried = [row for row in data["rows"] if row["measured"]]
    assert {row["strategy"] for row in tried} == {"zero2", "fsdp2", "fsdp2_no_reshard"}
    assert all(row["measured"]["status"] == "ok" and row["measured"]["tokens_per_s"] > 0 for row in tried)
    assert {row["family"] for row in tried} == {"DeepSpeed ZeRO", "FSDP2"}
    fastest = max(tried, key=lambda row: row["measured"]["tokens_per_s"])
    assert data["choice"]["candidate"] == fastest["candidate"]
    table = (out / "plan.md").read_text()
    assert "| FSDP2 | fsdp2 micro" in table and "| FSDP2 | fsdp2_no_reshard micro" in table
    assert "| DeepSpeed ZeRO | zero2 micro" in table


def test_an_fsdp2_export_gathers_the_model_as_built_on_rank_zeros_host():
    """The end-of-run export under FSDP2 gathers the fp32 state dict on rank 0's host, beside training's: a shard
    at a time where the probe found the model exports so, else whole."""
    import dataclasses

    from helpers import fake_probe

    from zerotrain.engines.states import ParamCounts
    from zerotrain.plan.memory import predict

    counts = ParamCounts(total=10**9, trainable=10**9, largest_layer=10**7, total_bytes=4 * 10**9,
                         trainable_bytes=4 * 10**9, largest_block=10**8, in_blocks=9 * 10**8)
    probe = dataclasses.replace(fake_probe(), host_base_bytes=3 * 2**30, host_before_model_bytes=2**30)
    plain = predict(counts, Strategy("fsdp2"), 1, False, 4, "bf16", probe)
    exported = predict(counts, Strategy("fsdp2"), 1, False, 4, "bf16", probe, export=True)
    assert exported.rank0_extra_bytes == pytest.approx(4e9)
    assert exported.host_bytes == pytest.approx(plain.host_bytes + 4e9)
    streamed = dataclasses.replace(probe, exports_streamed=True)
    small = predict(counts, Strategy("fsdp2"), 1, False, 4, "bf16", streamed, export=True)
    assert small.rank0_extra_bytes == pytest.approx(4e9)  # one shard holds the 4 GB model
    big = dataclasses.replace(counts, total=10**10, total_bytes=4 * 10**10)
    assert predict(big, Strategy("fsdp2"), 1, False, 4, "bf16", streamed, export=True).rank0_extra_bytes == \
        pytest.approx(5e9)  # a 5 GB shard, not the 40 GB model
