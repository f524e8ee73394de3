"""zerotrain.engines.ds_private.zero_host: ZeRO-1/2 on one rank without the identity reduction, and the gradient norm in one launch."""

from __future__ import annotations

import json
import types
from types import SimpleNamespace

import pytest
import torch
from test_fit import toy_config, train_log
from test_zero_clip import RecordOps

from zerotrain.engines.ds_private import zero_host
from zerotrain.train.loop import fit
from zerotrain.tasks.base import StepOutput
from zerotrain.tasks.toy import ToyTask


def _fit_counting_reductions(tmp_path, name: str, monkeypatch, task=ToyTask, **strategy) -> tuple[dict, int]:
    """A toy fit's train log, and how many buckets DeepSpeed's ZeRO-1/2 reduced (``allreduce_and_copy`` calls)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    calls = []
    original = DeepSpeedZeroOptimizer.allreduce_and_copy

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "allreduce_and_copy", counted)
    cfg = toy_config(tmp_path, name, gradient_clipping=0.05, **strategy)
    fit(task(cfg))
    return train_log(tmp_path / name), len(calls)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_skips_the_reduction_and_trains_bitwise_the_same(tmp_path, monkeypatch, stage, precision):
    """One rank, with gradient accumulation (2 micro-batches) and a clip that bites: DeepSpeed's reduction
    runs without zero_host and never with it, and the loss and grad-norm curves are bitwise the same (the
    skipped reduction divided by 1.0 and summed over one rank; here the one-launch norm rounds to
    DeepSpeed's float32 too)."""
    logs = {}
    reductions = {}
    for skip in (True, False):
        if not skip:
            for patch in ("skip_one_rank_reduction", "norm_in_one_launch", "rebind_only_moved_weights"):
                monkeypatch.setattr(f"zerotrain.engines.deepspeed.{patch}", lambda opt: False)
        logs[skip], reductions[skip] = _fit_counting_reductions(tmp_path, f"skip-{skip}", monkeypatch,
                                                                zero_stage=stage, precision=precision)
    assert reductions[False] > 0 and reductions[True] == 0
    assert sorted(logs[True]) == sorted(logs[False]) == list(range(1, 9))
    for step, row in logs[True].items():
        assert row["train_loss"] == logs[False][step]["train_loss"], step
        assert row["grad_norm"] == logs[False][step]["grad_norm"], step


class _ReentrantCheckpointed(torch.nn.Module):
    """The toy MLP with its output layer under reentrant activation checkpointing, as a user's own model may
    have it: that layer's backward runs in a second autograd pass, where ZeRO-2's gradient hooks fire apart.
    (Its input comes from the first layer and requires grad: a reentrant block fed the data alone would get
    no gradients at all.)"""

    def __init__(self, mlp: torch.nn.Sequential):
        super().__init__()
        self.first, self.last = mlp[:3], mlp[3]

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.first(x)
        return checkpoint(self.last, h, use_reentrant=True) if torch.is_grad_enabled() else self.last(h)


class _ReentrantToyTask(ToyTask):
    def build_model(self, pretrained: bool = True):
        return _ReentrantCheckpointed(super().build_model(pretrained))


def test_zero2_without_its_hooks_trains_the_same_under_reentrant_checkpointing(tmp_path, monkeypatch):
    """ZeRO-2 on one rank with its gradient hooks removed (the epilogue after backward reads every gradient):
    a model with a reentrant-checkpointed block, 2 micro-batches and a biting clip gives bitwise the loss and
    grad-norm curves DeepSpeed's own hooks and reduction give."""
    logs, reductions = {}, {}
    for skip in (True, False):
        if not skip:
            for patch in ("skip_one_rank_reduction", "norm_in_one_launch", "rebind_only_moved_weights"):
                monkeypatch.setattr(f"zerotrain.engines.deepspeed.{patch}", lambda opt: False)
        logs[skip], reductions[skip] = _fit_counting_reductions(tmp_path, f"reentrant-{skip}", monkeypatch,
                                                                task=_ReentrantToyTask, zero_stage=2)
    assert reductions[False] > 0 and reductions[True] == 0
    assert sorted(logs[True]) == sorted(logs[False]) == list(range(1, 9))
    for step, row in logs[True].items():
        assert row["train_loss"] == logs[False][step]["train_loss"], step
        assert row["grad_norm"] == logs[False][step]["grad_norm"], step
    assert logs[True][8]["train_loss"] < logs[True][1]["train_loss"]  # and it trains


def test_the_reduction_is_kept_where_it_is_not_the_identity(tmp_path, monkeypatch):
    """Contiguous gradients (the buckets the epilogue reads from), and communication in another dtype
    (a cast that rounds), keep DeepSpeed's reduction. Where it is skipped, ZeRO-2's gradient hooks go too."""
    real, verdicts = zero_host._reduction_is_identity, {}

    def spy(opt):
        """Asks for the real optimizer's verdict, then for the two variants' (the run keeps the first)."""
        verdicts["as built"] = real(opt)
        opt.contiguous_gradients = True
        verdicts["contiguous"] = real(opt)
        opt.contiguous_gradients, kept = False, opt.communication_data_type
        opt.communication_data_type = torch.bfloat16  # the toy trains in fp32
        verdicts["bf16 communication"] = real(opt)
        opt.communication_data_type = kept
        return verdicts["as built"]

    hooks = []

    def skip(opt):  # ZeRO-2 has a gradient hook per parameter tensor; the skip drops them all
        hooks.append(len(opt._grad_acc_hooks))
        skipped = zero_host.skip_one_rank_reduction(opt)
        hooks.append(len(opt._grad_acc_hooks))
        return skipped

    monkeypatch.setattr(zero_host, "_reduction_is_identity", spy)
    monkeypatch.setattr("zerotrain.engines.deepspeed.skip_one_rank_reduction", skip)
    _, reductions = _fit_counting_reductions(tmp_path, "run", monkeypatch, zero_stage=2)
    assert reductions == 0
    assert hooks == [len(list(ToyTask(toy_config(tmp_path, "count")).build_model().parameters())), 0]
    assert verdicts == {"as built": True, "contiguous": False, "bf16 communication": False}
    assert not zero_host.skip_one_rank_reduction(SimpleNamespace())  # not a ZeRO-1/2 optimizer


def _norm(method, grads: list[torch.Tensor], monkeypatch) -> tuple[torch.Tensor, list]:
    """``get_grad_norm_direct`` of an optimizer on one rank, and the ops it ran."""
    from deepspeed import comm

    monkeypatch.setattr(comm, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(comm, "all_reduce", lambda tensor, *args, **kwargs: None)  # one rank: the identity
    opt = SimpleNamespace(model_parallel_rank=0, device="cpu", dp_process_group=None,
                          _model_parallel_all_reduce=lambda tensor, op: None)
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    with RecordOps() as ops:
        norm = method(opt, grads, params)
    return norm, ops.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_the_one_launch_norm_is_deepspeeds(monkeypatch, dtype, poison):
    """The same float32 norm as DeepSpeed's per-tensor float64 norms (and its -1 for a gradient with inf
    or NaN), a ZeRO padding tensor left out; the ops run do not grow with the number of tensors."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    torch.manual_seed(0)
    grads = [torch.randn(*shape).to(dtype) * scale for shape, scale in
             (((64, 32), 1e-3), ((32,), 10.0), ((7, 5, 3), 1.0), ((1000,), 1e-6))]
    if poison is not None:
        grads[2][1, 1, 1] = poison
    padding = torch.zeros(5, dtype=dtype)
    padding._zero_padding = True
    theirs, _ = _norm(DeepSpeedZeroOptimizer.get_grad_norm_direct, [*grads, padding], monkeypatch)
    ours, ops = _norm(zero_host._grad_norm_direct, [*grads, padding], monkeypatch)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs), (ours, theirs)
    if poison is not None:
        assert ours.item() == -1.0
    _, more_ops = _norm(zero_host._grad_norm_direct, grads * 5, monkeypatch)
    assert len(more_ops) == len(ops)


def _global_norm(method, grads: list[torch.Tensor], monkeypatch, groups: int = 1, device: str = "cpu",
                 **flags) -> tuple[torch.Tensor, list]:
    """``scaled_global_norm`` of a one-rank optimizer whose ``groups`` parameter groups each hold ``grads``, with
    zerotrain's one-launch norm inside as the engine has it, and the ops it ran. ``flags``: optimizer attributes
    that make DeepSpeed's method the one to run (``cpu_offload``, ``has_moe_layers``, ``muon``)."""
    from deepspeed import comm
    from deepspeed.runtime.zero import stage_1_and_2

    from zerotrain.engines.ds_private.zero_clip import _mask_nan_or_inf

    monkeypatch.setattr(comm, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(comm, "all_reduce", lambda tensor, *args, **kwargs: None)  # one rank: the identity
    monkeypatch.setattr(stage_1_and_2, "mask_nan_or_inf_with_val_inplace", _mask_nan_or_inf)  # as the engine sets it
    grads = [g.to(device) for g in grads]
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    muon = flags.pop("muon", False)
    opt = SimpleNamespace(**{"model_parallel_rank": 0, "device": device, "dp_process_group": None, "cpu_offload": False,
                             "has_moe_layers": False, "bit16_groups": [params] * groups,
                             "params_in_partition": [params] * groups, "averaged_gradients": [grads] * groups,
                             "loss_scale": 1.0, "_muon_update_lacks_loss_scale": lambda i: muon,
                             "groups_lacking_loss_scale": {0} if muon else set(),
                             "_model_parallel_all_reduce": lambda tensor, op: None, **flags})
    opt._average_expert_grad_norms = lambda norms: None
    opt.get_grad_norm_direct = types.MethodType(zero_host._grad_norm_direct, opt)
    with RecordOps() as ops:
        norm = method(opt)
    return norm, ops.ops


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("poison, scale", [(None, 1.0), (None, 1e-20), (None, 1e-22), (1e19, 1.0), (float("inf"), 1.0),
                                           (float("nan"), 1.0), (3e38, 1.0)])
def test_the_one_group_global_norm_is_deepspeeds(monkeypatch, poison, scale, device):
    """One parameter group: bitwise DeepSpeed's method around the same one-launch norm (its -1 mask and its
    combination of groups), 12 fewer ops: a finite norm (tiny, down to one whose square is subnormal, or near
    float32's square root of its largest number) as it is, inf for a gradient with inf or NaN, and inf where the summed squares overflow float32."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    torch.manual_seed(0)
    grads = [torch.randn(64, 32) * 1e-3 * scale, torch.randn(32) * 10.0 * scale, torch.randn(7, 5, 3) * scale]
    if poison is not None:
        grads[2][1, 1, 1] = poison
    theirs, their_ops = _global_norm(DeepSpeedZeroOptimizer.scaled_global_norm, grads, monkeypatch, device=device)
    ours, our_ops = _global_norm(zero_host._scaled_global_norm, grads, monkeypatch, device=device)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs), (ours, theirs)
    assert (ours.item() == float("inf")) == (poison is not None and poison != 1e19)
    assert len(their_ops) - len(our_ops) >= 12, (our_ops, their_ops)


@pytest.mark.parametrize("flags", [{"groups": 2}, {"has_moe_layers": True}, {"muon": True},
                                   {"cpu_offload": True,  # whose norm DeepSpeed takes its own way: a stand-in
                                    "complete_grad_norm_calculation_for_cpu_offload": lambda params: torch.tensor(7.0)}])
def test_the_global_norm_is_deepspeeds_own_where_one_group_does_not_say_it_all(monkeypatch, flags):
    """Several groups, CPU offload (another norm), MoE (expert norms averaged) or a Muon update that lacks the
    loss scale: DeepSpeed's method runs, op for op."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    grads = [torch.tensor([3.0, -4.0])]
    theirs, their_ops = _global_norm(DeepSpeedZeroOptimizer.scaled_global_norm, grads, monkeypatch, **flags)
    ours, our_ops = _global_norm(zero_host._scaled_global_norm, grads, monkeypatch, **flags)
    assert torch.equal(ours, theirs) and our_ops == their_ops


def test_the_norm_of_another_order_is_deepspeeds(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    grads = [torch.tensor([3.0, -4.0]), torch.tensor([1.0])]
    theirs, _ = _norm(lambda *a: DeepSpeedZeroOptimizer.get_grad_norm_direct(*a, norm_type=float("inf")), grads,
                      monkeypatch)
    ours, _ = _norm(lambda *a: zero_host._grad_norm_direct(*a, norm_type=float("inf")), grads, monkeypatch)
    assert ours.item() == theirs.item() == 4.0


def test_weights_are_rebound_only_when_one_has_moved(tmp_path, monkeypatch):
    """After DeepSpeed's step every parameter already is its slice of the flat buffer, and DeepSpeed's
    rebinding is skipped; a parameter moved elsewhere is put back, values and all."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    deepspeeds, rebinds, checked = DeepSpeedZeroOptimizer._update_model_bit16_weights, [], []

    def counted(self, group_index):
        rebinds.append(group_index)
        return deepspeeds(self, group_index)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_update_model_bit16_weights", counted)
    real = zero_host.rebind_only_moved_weights

    def check(opt):
        assert real(opt)
        rebinds.clear()  # DeepSpeed's own, when the optimizer was built
        flat, params = opt.bit16_groups_flat[0], opt.bit16_groups[0]
        inside = [flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()
                  for p in params]
        opt._update_model_bit16_weights(0)
        assert all(inside) and rebinds == []  # in place: DeepSpeed's rebinding not run
        moved = params[-1]
        values = moved.detach().clone()
        moved.data = values.clone()  # its own storage now, outside the flat buffer
        opt._update_model_bit16_weights(0)
        assert rebinds == [0] and flat.data_ptr() <= moved.data_ptr() and torch.equal(moved.detach(), values)
        checked.append(True)
        return True

    monkeypatch.setattr("zerotrain.engines.deepspeed.rebind_only_moved_weights", check)
    fit(ToyTask(toy_config(tmp_path, "run", zero_stage=1)))
    assert checked == [True]


class LossOutsideTheModel(ToyTask):
    """A user's task whose loss and metric are computed in the output's dtype, outside the module: under bf16
    autocast they differ in value if the autocast covers them (DeepSpeed's forward autocasts the module only)."""

    def training_step(self, model, batch):
        pred = model(batch["x"])
        loss = torch.nn.functional.mse_loss(pred, batch["y"].to(pred.dtype)) + (pred @ pred.T).mean() * 1e-3
        return StepOutput(loss=loss, tokens=batch["x"].shape[0], samples=batch["x"].shape[0])

    def eval_step(self, model, batch):
        pred = model(batch["x"])
        sq = (pred - batch["y"].to(pred.dtype)) ** 2 + (pred @ pred.T).mean() * 1e-3
        return {"sq_err": float(sq.mean(-1).sum()), "count": batch["x"].shape[0]}


def _val_log(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_mse"] for r in rows if "val_mse" in r}


@pytest.mark.parametrize("task", [ToyTask, LossOutsideTheModel])
@pytest.mark.parametrize("precision", ["fp32", "autocast"])
def test_zero0_engine_patches_train_bitwise_the_same(tmp_path, monkeypatch, precision, task):
    """ZeRO-0 with the engine's gradients cleared from a list, its idle forward hooks removed and its forward
    and backward run directly: DeepSpeed's own zero_grad, forward and backward never run, the hooks are gone,
    and with 2 micro-batches and a biting clip the loss and grad-norm curves are bitwise those of DeepSpeed's
    zero_grad, hooks, forward and backward. "autocast" is the GPU fast path's ZeRO-0 bf16 (DeepSpeed's
    torch_autocast block), which a CPU run gets only by asking for it here."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from zerotrain.config import ds_config

    if precision == "autocast":
        real_fast_path = ds_config.fast_path
        monkeypatch.setattr(ds_config, "fast_path", lambda ds, device, ws: real_fast_path(ds, "cuda", ws))
    calls, engines = {"zero_grad": 0, "forward": 0, "backward": 0}, []

    def counting(name):
        deepspeeds = getattr(DeepSpeedEngine, name)

        def counted(self, *args, **kwargs):
            calls[name] += 1
            return deepspeeds(self, *args, **kwargs)
        return counted

    for name in calls:
        monkeypatch.setattr(DeepSpeedEngine, name, counting(name))
    real_drop = zero_host.drop_idle_forward_hooks
    logs, counts, vals = {}, {}, {}
    for patched in (True, False):
        calls.update(dict.fromkeys(calls, 0))
        if patched:
            monkeypatch.setattr("zerotrain.engines.deepspeed.drop_idle_forward_hooks", lambda e: engines.append(e) or real_drop(e))
        else:
            for patch in ("zero_grad_from_list", "drop_idle_forward_hooks", "forward_backward_add_nothing"):
                monkeypatch.setattr(f"zerotrain.engines.deepspeed.{patch}", lambda engine: False)
        cfg = toy_config(tmp_path, f"patched-{patched}", zero_stage=0, gradient_clipping=0.05,
                         precision="fp32" if precision == "fp32" else "bf16")
        cfg.trainer.eval_every_steps = 4
        fit(task(cfg))
        logs[patched], counts[patched] = train_log(tmp_path / f"patched-{patched}"), dict(calls)
        vals[patched] = _val_log(tmp_path / f"patched-{patched}")
    ds = engines[0]
    assert ds.torch_autocast_enabled() == (precision == "autocast")
    assert ds.module_forward_pre_hook is None and ds.module_forward_post_hook is None
    assert not ds.module._forward_pre_hooks and not ds.module._forward_hooks
    assert counts[True] == {"zero_grad": 0, "forward": 0, "backward": 0}
    # one zero_grad per optimizer step; a forward and a backward per micro-batch (evaluation's forwards besides)
    assert counts[False]["zero_grad"] == 8 and counts[False]["backward"] == 16 and counts[False]["forward"] >= 16
    assert sorted(logs[True]) == sorted(logs[False]) == list(range(1, 9))
    for step, row in logs[True].items():
        assert row["train_loss"] == logs[False][step]["train_loss"], step
        assert row["grad_norm"] == logs[False][step]["grad_norm"], step
    assert logs[True][8]["train_loss"] < logs[True][1]["train_loss"]  # and it trains
    assert len(vals[True]) >= 2 and vals[True] == vals[False]  # evaluation too (forward_model, eval_context, eval)


def test_zero0_engine_patches_stay_off_where_they_would_change_something():
    """Another stage (its optimizer clears the gradients), or a forward hook with work to do, keeps DeepSpeed's."""
    timers = SimpleNamespace(forward_timers=[])
    engine = SimpleNamespace(zero_optimization=lambda: True)
    assert not zero_host.zero_grad_from_list(engine)
    base = dict(zero_optimization_partition_weights=lambda: False, flops_profiler_enabled=lambda: False,
                random_ltd_enabled=lambda: False, fp16_auto_cast=lambda: False, memory_breakdown=lambda: False,
                autotuning_profile_model_info=lambda: False, is_deepcompile_enabled=lambda: False,
                engine_timers=timers, training_dataloader=None,
                tput_timer=SimpleNamespace(config=SimpleNamespace(enabled=False)), module_forward_pre_hook=None,
                module_forward_post_hook=None)
    assert zero_host.drop_idle_forward_hooks(SimpleNamespace(**base))
    for key, busy in (("flops_profiler_enabled", lambda: True), ("zero_optimization_partition_weights", lambda: True),
                      ("fp16_auto_cast", lambda: True), ("memory_breakdown", lambda: True),
                      ("engine_timers", SimpleNamespace(forward_timers=["forward_microstep"])),
                      ("tput_timer", SimpleNamespace(config=SimpleNamespace(enabled=True)))):
        assert not zero_host.drop_idle_forward_hooks(SimpleNamespace(**{**base, key: busy})), key


def test_deepspeeds_forward_and_backward_stay_where_they_do_something():
    """ZeRO-1..3, an fp16 or bf16 optimizer wrapper, an autocast GradScaler, a gradient all-reduce, DeepCompile,
    compiled autograd, unmanaged gradient accumulation or one of DeepSpeed's timers and profilers each keep
    DeepSpeed's forward and backward."""
    plain = object()
    base = dict(zero_optimization=lambda: False, optimizer=plain, basic_optimizer=plain,
                torch_autocast_z0_gradscaler=None, enable_backward_allreduce=False, is_deepcompile_enabled=lambda: False,
                _is_compiled_autograd_enabled=False, wall_clock_breakdown=lambda: False,
                flops_profiler_enabled=lambda: False, memory_breakdown=lambda: False,
                autotuning_profile_model_info=lambda: False, managed_gradient_accumulation=lambda: True)
    assert zero_host.forward_backward_add_nothing(SimpleNamespace(**base))
    for key, busy in (("zero_optimization", lambda: True), ("optimizer", object()),
                      ("torch_autocast_z0_gradscaler", object()), ("enable_backward_allreduce", True),
                      ("is_deepcompile_enabled", lambda: True), ("_is_compiled_autograd_enabled", True),
                      ("wall_clock_breakdown", lambda: True), ("flops_profiler_enabled", lambda: True),
                      ("memory_breakdown", lambda: True), ("autotuning_profile_model_info", lambda: True),
                      ("managed_gradient_accumulation", lambda: False)):
        assert not zero_host.forward_backward_add_nothing(SimpleNamespace(**{**base, key: busy})), key


_TWO_RANK_FIT = '''
import json, os, sys
from pathlib import Path
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
import zerotrain.engines.deepspeed
from zerotrain.cli import main

out, patched, argv = Path(sys.argv[1]), sys.argv[2] == "patched", sys.argv[3:]
if not patched:
    zerotrain.engines.deepspeed.reduce_scatter_into_partition = lambda opt: False
record = out.with_suffix(f".rank{os.environ['RANK']}.json")
calls = {"deepspeed": 0}
record.write_text(json.dumps(calls))  # rewritten at each call: a finished worker leaves by os._exit
original = DeepSpeedZeroOptimizer.allreduce_and_copy

def counted(self, *args, **kwargs):
    calls["deepspeed"] += 1
    record.write_text(json.dumps(calls))
    return original(self, *args, **kwargs)

DeepSpeedZeroOptimizer.allreduce_and_copy = counted
raise SystemExit(main(argv))
'''


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")]),
])
def test_two_ranks_reduce_scatter_into_their_partitions_bitwise_as_deepspeed(tmp_path, precision, device):
    """ZeRO-1 on two ranks (Gloo on CPU, NCCL on 2 GPUs), 2 micro-batches a step and a clip that bites: with the
    reduce-scatter into each rank's partition, DeepSpeed's all-reduce and copy-back never run, and the loss and
    grad-norm curves and the exported weights are bitwise those of DeepSpeed's own reduction (each element is
    one addition of the two ranks' halves either way)."""
    from conftest import run_python
    from safetensors.torch import load_file

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the Gloo case runs where there is no GPU (the toy would train on the GPU here)")

    script = tmp_path / "two_rank_fit.py"
    script.write_text(_TWO_RANK_FIT)
    logs, weights, reductions = {}, {}, {}
    for mode in ("patched", "deepspeed"):
        args = ["fit", "toy", "--trainer.max_steps", "6", "--trainer.log_every_steps", "1", "--trainer.num_workers",
                "0", "--trainer.micro_batch_size", "4", "--strategy.gradient_accumulation_steps", "2",
                "--strategy.zero_stage", "1", "--precision.dtype", precision,
                "--strategy.gradient_clipping", "0.05", "--optimizer.lr", "1e-2", "--logging.progress_bar", "false",
                "--trainer.output_dir", str(tmp_path), "--trainer.run_name", mode]
        out = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), str(tmp_path / mode), mode, *args], tmp_path)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        logs[mode] = train_log(tmp_path / mode)
        weights[mode] = load_file(tmp_path / mode / "model" / "model.safetensors")
        reductions[mode] = [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text())["deepspeed"] for r in (0, 1)]
    assert reductions["patched"] == [0, 0] and min(reductions["deepspeed"]) >= 6
    assert sorted(logs["patched"]) == sorted(logs["deepspeed"]) == list(range(1, 7))
    for step, row in logs["patched"].items():
        assert row["train_loss"] == logs["deepspeed"][step]["train_loss"], step
        assert row["grad_norm"] == logs["deepspeed"][step]["grad_norm"], step
    assert logs["patched"][6]["grad_norm"] > 0.05  # the clip bit
    assert sorted(weights["patched"]) == sorted(weights["deepspeed"])
    for name, tensor in weights["patched"].items():
        assert torch.equal(tensor, weights["deepspeed"][name]), name


_TWO_RANK_ENGINE = '''
import json, os, sys
import deepspeed, torch
from deepspeed.utils import safe_get_full_grad
from zerotrain.engines.ds_private.zero_host import norm_in_one_launch, reduce_scatter_into_partition

out, patched, optimizer = sys.argv[1], sys.argv[2] == "patched", sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config={
    "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": optimizer, "params": {"lr": 0.02}},
    "zero_optimization": {"stage": 1, "contiguous_gradients": False, "overlap_comm": False}})
applied = False
if patched:
    norm_in_one_launch(engine.optimizer)
    applied = reduce_scatter_into_partition(engine.optimizer)
rank = int(os.environ["RANK"])
data = torch.Generator().manual_seed(rank)
grads = []
for _ in range(3):
    x, y = torch.randn(4, 12, generator=data), torch.randn(4, 3, generator=data)
    engine.backward(((engine(x) - y) ** 2).mean())
    # Between backward and step, DeepSpeed's API assembles each full gradient from the ranks' partitions
    grads.append([safe_get_full_grad(p).flatten().tolist() for p in engine.module.parameters()])
    engine.step()
weights = [p.detach().flatten().tolist() for p in engine.module.parameters()]
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump({"applied": applied, "grads": grads, "weights": weights}, f)
'''


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
def test_the_reduce_scatter_keeps_deepspeeds_gradient_api_and_leaves_muon_alone(tmp_path, optimizer):
    """DeepSpeed's ``safe_get_full_grad`` between backward and step reads each parameter's pieces of the partition:
    with the reduce-scatter it returns DeepSpeed's own values. Muon's update is computed while DeepSpeed cuts
    those pieces out, so under Muon the patch declines and the run is DeepSpeed's."""
    from conftest import run_python

    if torch.cuda.is_available():
        pytest.skip("a Gloo case: it runs where there is no GPU")
    script = tmp_path / "engine.py"
    script.write_text(_TWO_RANK_ENGINE)
    results = {}
    for mode in ("patched", "deepspeed"):
        out = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
                          str(tmp_path / mode), mode, optimizer], tmp_path)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        results[mode] = [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["applied"] for r in results["patched"]] == [optimizer != "Muon"] * 2
    for rank in (0, 1):
        assert results["patched"][rank]["grads"] == results["deepspeed"][rank]["grads"]
        assert results["patched"][rank]["weights"] == results["deepspeed"][rank]["weights"]
