"""ZeRO-1/2's per-tensor host work, cut where it computes nothing or fits in one launch (DeepSpeed 0.19.8).

DeepSpeed handles ZeRO-1/2's gradients one parameter tensor at a time in Python. On a small model the
host then sets the pace: IMDB preset (b) (79 parameter tensors, CUDA-graphed encoder) took 19 ms a step
under ZeRO-1 against 8.4 ms in plain PyTorch on one H100. What each function here changes, and the
figures that keep it, are declared in :mod:`zerotrain.engines.ds_private.patches`:

* **The reduction on one rank** (:func:`skip_one_rank_reduction`). Each gradient is bucketed, flattened,
  divided by the world size, all-reduced and copied back tensor by tensor: with one data-parallel rank,
  the identity. The optimizer leaves the gradients where backward put them (and ZeRO-2's per-tensor
  hooks, which only feed that reduction, go); ZeRO's epilogue reads them as it reads reduced ones.
  It applies only where the reduction is the identity bit for bit (:func:`_reduction_is_identity`).
* **The gradient norm** (:func:`norm_in_one_launch`). DeepSpeed casts each gradient to float64 and takes
  its norm: two kernels and an allocation per tensor. ``torch._foreach_norm`` takes the same float64
  norms in one launch; on one rank the all-reduce of the result with itself is left out, and an
  invalid norm is masked to -1 without DeepSpeed's two host-device waits (:func:`zero_clip.mask_nan_or_inf`).
* **The one-group global norm** (:func:`one_group_norm`): for one parameter group, the group's norm
  where finite and inf where not, without the -1 mask and the combination of groups around it.
* **The rebinding** (:func:`rebind_only_moved_weights`): after every step DeepSpeed points each 16-bit
  parameter at its slice of the flat buffer again; skipped where every parameter already is that slice.
* **ZeRO-0's forward and backward** (:func:`forward_backward_add_nothing`): where DeepSpeed's wrap only
  autocast and ``loss.backward()``, the engine runs those two itself.
* **ZeRO-0's per-step walks** (:func:`zero_grad_from_list`, :func:`drop_idle_forward_hooks`): DeepSpeed walks
  the module tree for the gradients to clear every step, and calls forward hooks whose bodies are all
  switched off; the gradients are cleared from a list made once, and idle hooks are removed.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from zerotrain.engines.ds_private.zero_clip import mask_nan_or_inf


def one_rank_reduction_is_identity(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 on one rank, where reducing its gradients changes nothing."""
    return _is_zero12(optimizer) and _reduction_is_identity(optimizer)


def skip_one_rank_reduction(optimizer: Any) -> Callable[[], None]:
    """Give a ZeRO-1/2 ``optimizer`` on one rank a no-op gradient reduction (check
    :func:`one_rank_reduction_is_identity` first); returns the undo, which gives back DeepSpeed's method and hooks."""
    optimizer.reduce_ready_partitions_and_remove_grads = types.MethodType(_leave_gradient, optimizer)
    # ZeRO-2's hooks, one per parameter tensor, run in every backward to bucket each gradient as it arrives
    # and to count them. With nothing to reduce they have nothing to do: the engine runs the epilogue
    # after backward (allreduce_gradients), as it does at ZeRO-1, which has no hooks.
    had_hooks = bool(optimizer._grad_acc_hooks)
    for handle in optimizer._grad_acc_hooks:
        handle.remove()
    optimizer._grad_acc_hooks = []

    def undo() -> None:
        del optimizer.reduce_ready_partitions_and_remove_grads
        if had_hooks:
            optimizer.create_gradient_handling_hooks()
    return undo


def _leave_gradient(self: Any, param: torch.nn.Parameter, i: int) -> None:
    """Stands for ``reduce_ready_partitions_and_remove_grads``: the gradient stays in ``param.grad``,
    where the epilogue (``independent_gradient_partition_epilogue``) reads it."""


def _reduction_is_identity(opt: Any) -> bool:
    """Whether reducing ``opt``'s gradients leaves every value as it is, so that skipping it is exact.

    One rank in every data-parallel group; the gradients stay in ``param.grad`` (no contiguous
    buffers, no CPU offload copies, no separate accumulation attribute, no compact fp32 partition);
    no division other than by the world size (no sequence parallelism, no MoE expert groups); and
    communication in the gradients' own dtype (a cast there would round).
    """
    from deepspeed import comm as dist

    groups = [opt.dp_process_group, *opt.real_dp_process_group]
    if any(dist.get_world_size(group=g) != 1 for g in groups):
        return False
    if (opt.contiguous_gradients or opt.cpu_offload or opt.use_grad_accum_attribute or opt.has_moe_layers
            or getattr(opt, "zenflow", False) or getattr(opt, "sequence_parallel_size", 1) != 1):
        return False
    if any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups))):
        return False
    params = [p for group in opt.bit16_groups for p in group]
    return all(opt.get_param_comm_dtype(p) == p.dtype for p in params)


def norm_in_one_launch_applies(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ZeRO-1/2 without DeepSpeed's per-tensor norm rules that matter (pipeline-replicated
    parameters, a model-parallel rank other than 0)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED

    if not _is_zero12(optimizer) or getattr(optimizer, "model_parallel_rank", 0) != 0:
        return False
    return not any(hasattr(p, PIPE_REPLICATED) for group in optimizer.bit16_groups for p in group)


def norm_in_one_launch(optimizer: Any) -> Callable[[], None]:
    """Give a ZeRO-1/2 ``optimizer`` the one-launch gradient norm; returns the undo."""
    return replace_method(optimizer, "get_grad_norm_direct", _grad_norm_direct)


def one_group_norm_applies(optimizer: Any) -> bool:
    """Where the one-group global norm is bitwise DeepSpeed's: the DeepSpeed that combines groups keeping the -1
    invalid (0.19.8; an older one combined it into 1.0, and keeps its own method)."""
    from deepspeed.runtime.zero import stage_1_and_2

    return (norm_in_one_launch_applies(optimizer) and hasattr(stage_1_and_2, "combine_grad_norm_groups")
            and hasattr(optimizer, "_muon_update_lacks_loss_scale"))


def one_group_norm(optimizer: Any) -> Callable[[], None]:
    """Give a ZeRO-1/2 ``optimizer`` the one-group global norm (it falls back to DeepSpeed's itself); the undo."""
    return replace_method(optimizer, "scaled_global_norm", _scaled_global_norm)


def replace_method(obj: Any, name: str, function: Callable[..., Any]) -> Callable[[], None]:
    """Bind ``function`` as ``obj.name`` on this instance only; the undo deletes it, so the class's method is
    found again."""
    setattr(obj, name, types.MethodType(function, obj))

    def undo() -> None:
        delattr(obj, name)
    return undo


def _grad_norm_direct(self: Any, gradients: list[torch.Tensor], params: list[torch.nn.Parameter],
                      norm_type: float = 2) -> torch.Tensor:
    """``DeepSpeedZeroOptimizer.get_grad_norm_direct`` for the L2 norm: every gradient's norm in DeepSpeed's
    norm dtype (float64 where the device has it), squared, summed, reduced and rooted in DeepSpeed's
    order. The per-tensor norms come from one ``_foreach_norm``: a different kernel, so they may differ
    from DeepSpeed's in the last bit of a float64, far below the float32 the norm is used in."""
    from deepspeed.runtime.zero import stage_1_and_2

    if float(norm_type) != 2.0:
        return stage_1_and_2.DeepSpeedZeroOptimizer.get_grad_norm_direct(self, gradients, params, norm_type)
    total = _l2_norm(self, gradients)
    mask_nan_or_inf(total)  # DeepSpeed's mask, without its two host-device waits
    return total


def _l2_norm(self: Any, gradients: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of a ZeRO-1/2 optimizer's ``gradients`` over every rank, as DeepSpeed takes it before masking:
    inf or NaN where a gradient holds one."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.utils import get_norm_dtype

    grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
    if grads:
        norms = torch._foreach_norm(grads, 2, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2).sum().float()
    else:
        total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
    if dist.get_world_size(group=self.dp_process_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    return total.pow(0.5)


def _scaled_global_norm(self: Any, norm_type: float = 2) -> torch.Tensor:
    """``DeepSpeedZeroOptimizer.scaled_global_norm`` for one parameter group, bitwise.

    DeepSpeed masks the group's inf/NaN norm to -1, then ``combine_grad_norm_groups`` takes the L2 norm of the
    groups' norms and returns inf where one is -1 (or not finite). For one group that is the L2 norm of the one
    value where it is finite and inf where it is not: 4 ops after the norm instead of 16 (``norm < inf`` is
    false for inf and NaN alike, in one op where ``isfinite`` takes four)."""
    from deepspeed.runtime.zero import stage_1_and_2

    # The group's membership first: DeepSpeed's Muon check compares the loss scale, a read where it is a tensor
    if (len(self.bit16_groups) != 1 or self.cpu_offload or self.has_moe_layers or float(norm_type) != 2.0
            or (0 in getattr(self, "groups_lacking_loss_scale", ()) and self._muon_update_lacks_loss_scale(0))):
        return stage_1_and_2.DeepSpeedZeroOptimizer.scaled_global_norm(self, norm_type)
    norm = _l2_norm(self, self.averaged_gradients[0])
    return torch.where(norm < float("inf"), torch.linalg.vector_norm(norm), float("inf"))


def rebind_applies(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ZeRO-1/2 with every parameter its own round-robin twin (zerotrain's one group
    always), where DeepSpeed's second rebinding pass is a no-op."""
    if not _is_zero12(optimizer):
        return False
    # DeepSpeed's second pass sets each parameter to its round-robin twin's .data: a no-op only where every
    # twin is the parameter itself. Parameters never change object, so this is checked once.
    return all(p is ordered[indices[k]]
               for group, ordered, indices in zip(optimizer.bit16_groups, optimizer.round_robin_bit16_groups,
                                                  optimizer.round_robin_bit16_indices)
               for k, p in enumerate(group))


def rebind_only_moved_weights(optimizer: Any) -> Callable[[], None]:
    """Give a ZeRO-1/2 ``optimizer`` the rebinding that runs only when a parameter has left its slice of the flat
    buffer (check :func:`rebind_applies` first); returns the undo."""
    return replace_method(optimizer, "_update_model_bit16_weights", _update_model_bit16_weights)


def _update_model_bit16_weights(self: Any, group_index: int) -> None:
    """``DeepSpeedZeroOptimizer._update_model_bit16_weights`` where it changes something. It sets each
    parameter's ``.data`` to ``flat.narrow(0, offset, numel).view(shape)`` (in its round-robin order), then
    each parameter to its round-robin twin's ``.data``, the parameter itself (checked when patched): when
    every parameter already is that view (same address, shape and layout), both are no-ops."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    flat = self.bit16_groups_flat[group_index]
    base, size = flat.data_ptr(), flat.element_size()
    ordered = self.round_robin_bit16_groups[group_index]
    in_place = all(p.data_ptr() == base + offset * size and p.shape == meta.shape and p.is_contiguous()
                   for p, meta, offset in zip(ordered, self.round_robin_bit16_meta[group_index],
                                              self.round_robin_bit16_offsets[group_index]))
    if not in_place:
        DeepSpeedZeroOptimizer._update_model_bit16_weights(self, group_index)


def forward_backward_add_nothing(engine: Any) -> bool:
    """Whether a DeepSpeed ``engine``'s ``forward`` and ``backward`` compute nothing beyond autocast around its
    module and ``(loss / gradient_accumulation_steps).backward()``, so the caller may run those directly.

    That holds at ZeRO-0 when the optimizer is the plain one (no ZeRO, fp16 or bf16 wrapper, no autocast
    GradScaler) and the gradients are not all-reduced after backward (one rank, where zerotrain's clip
    switches the identity reduction off). DeepSpeed (0.19.8) still wraps every forward in a context of its
    deep compiler, a hook on the output that runs its backward prologue, and every backward in lock-guarded
    counters, a graph tracker with its own hook, timers that are off and a memory report that is off: host
    time a small model's step waits for (its backward ~0.2 ms against ``loss.backward()`` and its forward
    ~0.1 ms more than the module's on a 2-core CPU). Its ``step`` (optimizer,
    schedule, counters) is still called, so checkpoints and the schedule are DeepSpeed's own."""
    return (not engine.zero_optimization() and engine.optimizer is engine.basic_optimizer
            and engine.torch_autocast_z0_gradscaler is None and not engine.enable_backward_allreduce
            and not engine.is_deepcompile_enabled() and not engine._is_compiled_autograd_enabled
            and not engine.wall_clock_breakdown() and not engine.flops_profiler_enabled()
            and not engine.memory_breakdown() and not engine.autotuning_profile_model_info()
            # unmanaged accumulation: DeepSpeed's backward counts micro-batches that its step reads
            and engine.managed_gradient_accumulation())


def _is_zero12(optimizer: Any) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, DeepSpeedZeroOptimizer)


def is_zero0(engine: Any) -> bool:
    """Whether DeepSpeed ``engine`` runs without ZeRO (stage 0), whose optimizer does not clear the gradients."""
    return not engine.zero_optimization()


def zero_grad_from_list(engine: Any) -> Callable[[], None]:
    """Give a ZeRO-0 ``engine`` (:func:`is_zero0`) a ``zero_grad`` that sets ``.grad = None`` on a list of its
    module's parameters made now; returns the undo (the class's method again).

    DeepSpeed's (0.19.8) sets ``param.grad = None`` for every ``module.named_parameters()``, a walk of the module
    tree each step. The parameters never change object after ``deepspeed.initialize`` (its optimizer holds them),
    so the list names the same tensors, deduplicated as ``named_parameters`` does; the gradients end the same."""
    params = list(engine.module.parameters())

    def zero_grad(*args: Any, **kwargs: Any) -> None:
        for p in params:
            p.grad = None

    engine.zero_grad = zero_grad  # an instance attribute over the class's method
    return lambda: engine.__dict__.pop("zero_grad", None)


def forward_hooks_idle(engine: Any) -> bool:
    """Whether ``engine``'s forward pre- and post-hooks would do nothing: ``_forward_prologue``/``_forward_epilogue``
    only start and stop timers (wall clock; throughput when DeepSpeed was given no data loader), the flops
    profiler, random-LTD, fp16 input casting, ZeRO-3's external-parameter marking and a memory report, all off."""
    return (not engine.zero_optimization_partition_weights() and not engine.flops_profiler_enabled()
            and not engine.random_ltd_enabled() and not engine.fp16_auto_cast() and not engine.memory_breakdown()
            and not engine.autotuning_profile_model_info() and not engine.is_deepcompile_enabled()
            and not engine.engine_timers.forward_timers
            and not (engine.training_dataloader is None and engine.tput_timer.config.enabled)
            and any(getattr(engine, name, None) is not None for name in _FORWARD_HOOKS))


_FORWARD_HOOKS = ("module_forward_pre_hook", "module_forward_post_hook")


def drop_idle_forward_hooks(engine: Any) -> Callable[[], None]:
    """Remove ``engine``'s idle forward hooks (check :func:`forward_hooks_idle` first): they are empty calls that
    also take the module off ``nn.Module``'s hook-free call path. DeepSpeed removes the same two itself while
    DeepCompile is active. Returns the undo, which registers DeepSpeed's hooks again."""
    for name in _FORWARD_HOOKS:
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
            setattr(engine, name, None)

    def undo() -> None:
        engine.module_forward_pre_hook = engine._create_module_forward_pre_hook()
        engine.module_forward_post_hook = engine._create_module_forward_post_hook()
    return undo
