"""zerotrain.engines.ds_private.zero_host: ZeRO-1/2 on one rank without the identity reduction, and the gradient norm in one launch."""

from __future__ import annotations

import dataclasses
import json
import types
from types import SimpleNamespace

import pytest
import torch
from helpers import RecordOps, toy_config, train_log

from zerotrain.engines.ds_private import patches, zero_host

# DeepSpeed's own methods are the reference: the patches' versions only (elsewhere they do not apply)
pytestmark = pytest.mark.skipif(not patches.patches_for(patches.installed_version()),
                                reason="zerotrain's DeepSpeed patches apply only to the versions they were verified on")
from zerotrain.train.loop import fit
from zerotrain.tasks.base import StepOutput
from zerotrain.tasks.toy import ToyTask


def without_patches(monkeypatch, *names: str) -> None:
    """The engines built after this call get every patch but ``names`` (DeepSpeed's own methods there)."""
    monkeypatch.setattr(patches, "PATCHES", tuple(p for p in patches.PATCHES if p.name not in names))


def with_patch(monkeypatch, name: str, **fields) -> None:
    """Patch ``name`` with ``fields`` replaced (e.g. a spy around its ``apply``) in the engines built after this call."""
    monkeypatch.setattr(patches, "PATCHES", tuple(dataclasses.replace(p, **fields) if p.name == name else p
                                                  for p in patches.PATCHES))


ZERO12_HOST = ("zero12_one_rank_no_reduction", "zero12_norm_one_launch", "zero12_one_group_norm",
               "zero12_rebind_only_moved")


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
            without_patches(monkeypatch, *ZERO12_HOST)
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
            without_patches(monkeypatch, *ZERO12_HOST)
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
        undo = zero_host.skip_one_rank_reduction(opt)
        hooks.append(len(opt._grad_acc_hooks))
        return undo

    monkeypatch.setattr(zero_host, "_reduction_is_identity", spy)
    with_patch(monkeypatch, "zero12_one_rank_no_reduction", apply=skip)
    _, reductions = _fit_counting_reductions(tmp_path, "run", monkeypatch, zero_stage=2)
    assert reductions == 0
    assert hooks == [len(list(ToyTask(toy_config(tmp_path, "count")).build_model().parameters())), 0]
    assert verdicts == {"as built": True, "contiguous": False, "bf16 communication": False}
    assert not zero_host.one_rank_reduction_is_identity(SimpleNamespace())  # not a ZeRO-1/2 optimizer


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

    monkeypatch.setattr(comm, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(comm, "all_reduce", lambda tensor, *args, **kwargs: None)  # one rank: the identity
    # DeepSpeed's method masks with its own function; the one-group norm has no mask (both bitwise the same)
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
        undo = real(opt)
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
        return undo

    with_patch(monkeypatch, "zero12_rebind_only_moved", apply=check)
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
def test_zero0_direct_forward_backward_trains_bitwise_the_same(tmp_path, monkeypatch, precision, task):
    """ZeRO-0 with its forward and backward run directly: DeepSpeed's own forward and backward never run, and with
    2 micro-batches and a biting clip the loss, grad-norm and validation curves are bitwise those of DeepSpeed's
    forward and backward. "autocast" is the GPU fast path's ZeRO-0 bf16 (DeepSpeed's torch_autocast block), which
    a CPU run gets only by asking for it here."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from zerotrain.config import ds_config

    if precision == "autocast":
        real_fast_path = ds_config.fast_path
        monkeypatch.setattr(ds_config, "fast_path", lambda ds, device, ws: real_fast_path(ds, "cuda", ws))
    calls, engines = {"forward": 0, "backward": 0}, []

    def counting(name):
        deepspeeds = getattr(DeepSpeedEngine, name)

        def counted(self, *args, **kwargs):
            calls[name] += 1
            return deepspeeds(self, *args, **kwargs)
        return counted

    for name in calls:
        monkeypatch.setattr(DeepSpeedEngine, name, counting(name))
    real_applies = zero_host.forward_backward_add_nothing
    logs, counts, vals = {}, {}, {}
    for patched in (True, False):
        calls.update(dict.fromkeys(calls, 0))
        if patched:
            with_patch(monkeypatch, "zero0_direct_forward_backward",
                       applies=lambda e: engines.append(e) or real_applies(e))
        else:
            without_patches(monkeypatch, "zero0_direct_forward_backward")
        cfg = toy_config(tmp_path, f"patched-{patched}", zero_stage=0, gradient_clipping=0.05,
                         precision="fp32" if precision == "fp32" else "bf16")
        cfg.trainer.eval_every_steps = 4
        fit(task(cfg))
        logs[patched], counts[patched] = train_log(tmp_path / f"patched-{patched}"), dict(calls)
        vals[patched] = _val_log(tmp_path / f"patched-{patched}")
    ds = engines[0]
    assert ds.torch_autocast_enabled() == (precision == "autocast")
    assert counts[True] == {"forward": 0, "backward": 0}
    # a forward and a backward per micro-batch (evaluation's forwards besides)
    assert counts[False]["backward"] == 16 and counts[False]["forward"] >= 16
    assert sorted(logs[True]) == sorted(logs[False]) == list(range(1, 9))
    for step, row in logs[True].items():
        assert row["train_loss"] == logs[False][step]["train_loss"], step
        assert row["grad_norm"] == logs[False][step]["grad_norm"], step
    assert logs[True][8]["train_loss"] < logs[True][1]["train_loss"]  # and it trains
    assert len(vals[True]) >= 2 and vals[True] == vals[False]  # evaluation too (forward_model, eval_context, eval)


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


ZERO0_WALKS = ("zero0_zero_grad_from_list", "zero0_drop_idle_forward_hooks")


def test_zero0_gradient_list_and_idle_hooks_train_bitwise_the_same_and_undo(tmp_path, monkeypatch):
    """ZeRO-0 with its gradients cleared from a list and its idle forward hooks removed: with 2 micro-batches and a
    biting clip the loss and grad-norm curves are bitwise DeepSpeed's own; undone, the engine has DeepSpeed's
    zero_grad and both hooks again."""
    from zerotrain.engines import deepspeed as ds_engine

    seen = []
    real_apply = patches.apply_patches
    monkeypatch.setattr(ds_engine, "apply_patches", lambda engine: seen.append((engine, real_apply(engine))) or seen[-1][1])
    logs = {}
    for patched in (True, False):
        if not patched:
            without_patches(monkeypatch, *ZERO0_WALKS)
        fit(ToyTask(toy_config(tmp_path, f"walks-{patched}", zero_stage=0, gradient_clipping=0.05)))
        logs[patched] = train_log(tmp_path / f"walks-{patched}")
    assert sorted(logs[True]) == list(range(1, 9))
    for step, row in logs[True].items():
        assert (row["train_loss"], row["grad_norm"]) == (logs[False][step]["train_loss"], logs[False][step]["grad_norm"])
    engine, applied = seen[0]
    assert set(ZERO0_WALKS) <= set(applied.names)
    assert not set(ZERO0_WALKS) & set(seen[1][1].names)
    assert "zero_grad" in vars(engine) and engine.module_forward_pre_hook is None
    applied.undo()
    assert "zero_grad" not in vars(engine)
    assert engine.module_forward_pre_hook is not None and engine.module_forward_post_hook is not None
