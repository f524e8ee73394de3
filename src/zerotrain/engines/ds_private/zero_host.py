"""ZeRO-1/2's per-tensor host work, cut where it computes nothing or fits in one launch.

DeepSpeed (0.19.8) handles ZeRO-1/2's gradients one parameter tensor at a time in Python. On a small
model the host then sets the pace: on one H100, IMDB preset (b) (79 parameter tensors, CUDA-graphed
encoder) took 19 ms a step under ZeRO-1 against 8.4 ms in plain PyTorch, with 8.9 ms of host time in
the backward and 8.9 ms in the optimizer step against 5.4 and 2.4 (BENCHMARKS.md, session 15). Two
of those per-tensor costs buy nothing:

* **The reduction on one rank.** Each gradient is bucketed, the bucket is flattened, divided by the
  world size, all-reduced and copied back tensor by tensor. With one data-parallel rank that is the
  identity (a division by 1.0, a sum over one rank, a copy of the same values).
  :func:`skip_one_rank_reduction` has such an optimizer leave the gradients where backward put them
  (and drops ZeRO-2's per-tensor gradient hooks, which only feed that reduction); ZeRO's epilogue then
  reads them exactly as it reads the reduced ones. It applies only where the
  reduction is the identity bit for bit, see :func:`_reduction_is_identity`.
* **The gradient norm.** DeepSpeed casts each gradient to float64 and takes its norm: two kernels and
  a tensor allocation per parameter tensor. :func:`norm_in_one_launch` takes the same float64 norms
  with ``torch._foreach_norm`` (one multi-tensor launch) and sums them as DeepSpeed does; on one rank
  it also leaves out the all-reduce of the result with itself. With one parameter group (zerotrain's always),
  :func:`_scaled_global_norm` also skips what DeepSpeed wraps around that norm: an inf/NaN mask to -1 and a
  combination of the groups that turns the -1 back into inf: 16 small ops (4 left) and their Python for one
  value, where py-spy found 6% of ZeRO-1's loop thread at IMDB (b) on an H200. The same values, in fewer
  launches: a median 0.48 ms less host time in a ZeRO-1 step there (2.09 against 2.57 ms, BENCHMARKS.md, session 25).

On several ranks ZeRO-1 reduces more than it uses: every gradient is all-reduced, though a rank updates
only its partition, and then copied back, tensor by tensor, and cut out again.
:func:`reduce_scatter_into_partition` flattens the gradients once and reduce-scatters them, so each rank
receives its partition and nothing else (on 2 x H200, BERT-base: 1,023,908 against 998,915 tokens/s,
BENCHMARKS.md session 21, measured before the partition was handed over as per-parameter views).

And one that repeats work already done: after every step DeepSpeed points each 16-bit parameter at its
slice of the flat buffer again ("just to be safe", its comment says), though the step wrote into that
buffer in place. :func:`rebind_only_moved_weights` keeps the rebinding for a parameter that has moved
and skips it where every parameter already is that slice.

ZeRO-0 keeps DeepSpeed's engine (forward, backward, step) around plain PyTorch arithmetic, and two of its
per-step host costs do nothing there: :func:`zero_grad_from_list` clears the gradients from a list of
the parameters made once, where DeepSpeed walks the module tree for them every step, and
:func:`drop_idle_forward_hooks` removes the module hooks around every forward whose bodies only start
timers, profilers and ZeRO-3 bookkeeping that are off. On one rank, :func:`forward_backward_add_nothing` tells the
engine when DeepSpeed's ``forward`` and ``backward`` are autocast and ``loss.backward()`` plus bookkeeping, so that it
runs those two directly (0.29 ms less host time an IMDB (b) step on an H200, BENCHMARKS.md session 26).
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch


def skip_one_rank_reduction(optimizer: Any) -> bool:
    """Give a ZeRO-1/2 ``optimizer`` on one rank a no-op gradient reduction; False (nothing changed) where
    the reduction is not the identity or the optimizer is not DeepSpeed's ZeRO-1/2."""
    if not _is_zero12(optimizer) or not _reduction_is_identity(optimizer):
        return False
    optimizer.reduce_ready_partitions_and_remove_grads = types.MethodType(_leave_gradient, optimizer)
    # ZeRO-2's hooks, one per parameter tensor, run in every backward to bucket each gradient as it arrives
    # and to count them. With nothing to reduce they have nothing to do: the engine runs the epilogue
    # after backward (allreduce_gradients), as it does at ZeRO-1, which has no hooks.
    for handle in optimizer._grad_acc_hooks:
        handle.remove()
    optimizer._grad_acc_hooks = []
    return True


def reduce_scatter_into_partition(optimizer: Any) -> bool:
    """Give a multi-rank ZeRO-1 ``optimizer`` a gradient reduction that reduce-scatters one flat buffer straight
    into this rank's partition; False (nothing changed) where DeepSpeed's own path differs in what it computes
    or in the memory it holds.

    DeepSpeed (0.19.8) all-reduces every gradient, although a rank updates only its partition; copies the
    reduced values back into each ``param.grad`` (one copy per tensor); then cuts its partition out of those
    tensors piece by piece, and its step flattens the pieces again. Here the gradients are flattened once, in
    the layout of the flat 16-bit weights (so the partitions' bounds are the same), divided by the world size
    as DeepSpeed divides them, and reduce-scattered: each rank receives its own summed partition and nothing
    else (half the all-reduce's bytes on the wire). The step takes that partition as DeepSpeed's pre-flattened
    one, and everything that reads the per-parameter pieces (the gradient norm, the overflow check,
    ``safe_get_full_grad``) finds them as views into it, in DeepSpeed's order. On two ranks every element is
    the same one addition either way, so the result is bitwise DeepSpeed's; on more, NCCL may add the ranks'
    values in another order (float rounding, not a different sum).

    Only ZeRO-1 (no gradient hooks: the reduction runs once, after the last micro-batch's backward), with the
    gradients in ``param.grad`` (no contiguous buckets, no CPU offload, no accumulation attribute, no compact
    fp32 partition), no MoE, sequence parallelism or Muon (whose update DeepSpeed computes while it cuts the
    pieces out), communication in the gradients' own dtype, the flat layout in parameter order without
    per-tensor padding, and each group within one reduce bucket (``reduce_bucket_size``): DeepSpeed then
    flattens the whole group at once too, so the peak memory is the same. The ``reduce_scatter`` key does
    not apply: DeepSpeed reads it only on the contiguous-gradients path.
    """
    from deepspeed import comm as dist

    if not _is_zero12(optimizer) or not _partitions_from_one_flat_buffer(optimizer):
        return False
    if any(dist.get_world_size(group=g) == 1 for g in optimizer.real_dp_process_group):
        return False  # one rank: skip_one_rank_reduction leaves the gradients where they are instead
    optimizer._zerotrain_pieces = [_partition_pieces(optimizer, i) for i in range(len(optimizer.bit16_groups))]
    optimizer.reduce_gradients = types.MethodType(_reduce_scatter_gradients, optimizer)
    return True


def _partitions_from_one_flat_buffer(opt: Any) -> bool:
    """The conditions of :func:`reduce_scatter_into_partition` on ``opt``'s configuration and layout."""
    if (opt.partition_gradients or opt.overlap_comm or opt.contiguous_gradients or opt.cpu_offload
            or opt.use_grad_accum_attribute or opt.has_moe_layers or getattr(opt, "zenflow", False)
            or getattr(opt, "sequence_parallel_size", 1) != 1 or opt._grad_acc_hooks):
        return False
    if any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups))):
        return False
    if opt.real_dp_process_group != [opt.dp_process_group] * len(opt.bit16_groups):
        return False
    for i, group in enumerate(opt.bit16_groups):
        ordered, offsets = opt.round_robin_bit16_groups[i], opt.round_robin_bit16_offsets[i]
        if len(ordered) != len(group) or any(p is not q for p, q in zip(group, ordered)):
            return False
        if any(getattr(p, "use_muon", False) for p in group):
            return False
        if any(opt.round_robin_bit16_padding[i]) or any(opt.get_param_comm_dtype(p) != p.dtype for p in group):
            return False
        starts = [0]
        for p in group[:-1]:
            starts.append(starts[-1] + p.numel())
        total = starts[-1] + group[-1].numel()
        if list(offsets) != starts or opt.bit16_groups_flat[i].numel() < total or total > opt.reduce_bucket_size:
            return False
    return True


def _partition_pieces(opt: Any, i: int) -> list[tuple[int, int, Optional[torch.Size]]]:
    """Where group ``i``'s per-parameter gradient pieces lie in this rank's partition, in DeepSpeed's order
    (``params_in_partition``): (offset, elements, shape where the piece is a whole tensor, else None), and
    (offset, elements, None) with elements < 0 for zero padding. Computed once: the layout never changes."""
    from deepspeed import comm as dist

    size, rank = int(opt.partition_size[i]), dist.get_rank(group=opt.real_dp_process_group[i])
    pieces, filled = [], 0
    for param in opt.params_in_partition[i]:
        param_id = opt.get_param_id(param)
        start = int(opt.grad_start_offset[i][rank][param_id])
        offset = int(opt.grad_partition_insertion_offset[i][rank][param_id])
        count = min(param.numel() - start, size - offset)
        if offset > filled:
            pieces.append((filled, -(offset - filled), None))
        if count > 0:
            pieces.append((offset, count, param.shape if start == 0 and count == param.numel() else None))
            filled = offset + count
    if filled < size:
        pieces.append((filled, -(size - filled), None))
    return pieces


def _reduce_scatter_gradients(self: Any, pipeline_parallel: bool = False) -> None:
    """Stands for ``DeepSpeedZeroOptimizer.reduce_gradients`` (with its epilogue) at ZeRO-1: each group's
    gradients, flattened with zeros for a parameter that got none and for the flat buffer's tail padding,
    averaged and reduce-scattered into this rank's partition, which the step reads as pre-flattened.
    (``pipeline_parallel`` only makes DeepSpeed allocate contiguous buckets, which this path has none of.)"""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

    for i, group in enumerate(self.bit16_groups):
        process_group = self.real_dp_process_group[i]
        flat_weights = self.bit16_groups_flat[i]
        pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                  for p in group]
        tail = flat_weights.numel() - sum(piece.numel() for piece in pieces)
        if tail:
            pieces.append(torch.zeros(tail, dtype=flat_weights.dtype, device=flat_weights.device))
        flat = torch.cat(pieces)
        del pieces
        for p in group:
            p.grad = None  # the flat copy holds them now: their memory is free for the partition
        if self.gradient_average:
            flat.div_(dist.get_world_size(group=process_group))  # before the sum, as DeepSpeed's allreduce_bucket
        partition = torch.empty(int(self.partition_size[i]), dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_fn(partition, flat, group=process_group)
        views = []
        for offset, count, shape in self._zerotrain_pieces[i]:
            view = partition.narrow(0, offset, abs(count))
            if count < 0:
                view._zero_padding = True  # DeepSpeed's mark: the norm leaves it out
            views.append(view.view(shape) if shape is not None else view)
        self.averaged_gradients[i] = GradPartitionBufferGroup(views, partition)
        self.all_grad_tensors[i] = None
    # DeepSpeed's epilogue ends the same way: no gradient left in .grad, this backward's reduction done.
    self._clear_param_grad_only()
    self._epilogue_ran_this_backward = True


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


def norm_in_one_launch(optimizer: Any) -> bool:
    """Give a ZeRO-1/2 ``optimizer`` the one-launch gradient norm; False (nothing changed) where DeepSpeed's
    per-tensor rules matter (pipeline-replicated parameters, a model-parallel rank other than 0)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED

    if not _is_zero12(optimizer) or getattr(optimizer, "model_parallel_rank", 0) != 0:
        return False
    if any(hasattr(p, PIPE_REPLICATED) for group in optimizer.bit16_groups for p in group):
        return False
    optimizer.get_grad_norm_direct = types.MethodType(_grad_norm_direct, optimizer)
    # Bitwise only against the DeepSpeed that combines groups keeping the -1 invalid (0.19.8); an older one
    # combined it into 1.0, and keeps its own method
    from deepspeed.runtime.zero import stage_1_and_2

    if hasattr(stage_1_and_2, "combine_grad_norm_groups") and hasattr(optimizer, "_muon_update_lacks_loss_scale"):
        optimizer.scaled_global_norm = types.MethodType(_scaled_global_norm, optimizer)
    return True


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
    # The module's global, so that zero_clip's sync-free mask applies here as it does to DeepSpeed's method.
    stage_1_and_2.mask_nan_or_inf_with_val_inplace(total, device=self.device)
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


def rebind_only_moved_weights(optimizer: Any) -> bool:
    """Give a ZeRO-1/2 ``optimizer`` the rebinding that runs only when a parameter has left its slice of the
    flat buffer; False (nothing changed) for any other optimizer."""
    if not _is_zero12(optimizer):
        return False
    # DeepSpeed's second pass sets each parameter to its round-robin twin's .data: a no-op only where every
    # twin is the parameter itself (zerotrain's one group always). Parameters never change object, so once.
    for group, ordered, indices in zip(optimizer.bit16_groups, optimizer.round_robin_bit16_groups,
                                       optimizer.round_robin_bit16_indices):
        if any(p is not ordered[indices[k]] for k, p in enumerate(group)):
            return False
    optimizer._update_model_bit16_weights = types.MethodType(_update_model_bit16_weights, optimizer)
    return True


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


def zero_grad_from_list(engine: Any) -> bool:
    """Give a ZeRO-0 DeepSpeed ``engine`` a ``zero_grad`` that sets ``.grad = None`` on a list of its module's
    parameters made now; False (nothing changed) at ZeRO-1/2/3, whose optimizers clear their own gradients.

    DeepSpeed's (0.19.8) sets ``param.grad = None`` for every ``module.named_parameters()``, a walk of the
    module tree (for IMDB (b), 80 generators and ~400 ``named_modules`` steps, ~0.1 ms on a CPU) each
    step. The parameters never change object after ``deepspeed.initialize`` (its optimizer holds them), so
    the list names the same tensors, deduplicated as ``named_parameters`` does; the gradients end the same.
    """
    if engine.zero_optimization():
        return False
    params = list(engine.module.parameters())

    def zero_grad() -> None:
        for p in params:
            p.grad = None

    engine.zero_grad = zero_grad  # an instance attribute: the class's method for any other engine
    return True


def drop_idle_forward_hooks(engine: Any) -> bool:
    """Remove a DeepSpeed ``engine``'s forward pre- and post-hooks on its module where both would do nothing;
    False (kept) otherwise.

    They call ``_forward_prologue``/``_forward_epilogue`` around every forward; those only start and stop
    wall-clock timers, the throughput timer (when DeepSpeed was given no data loader), the flops
    profiler, random-LTD, fp16 input casting and ZeRO-3's external-parameter marking, and report memory.
    With all of those off the hooks are empty calls that also take the module off ``nn.Module``'s
    hook-free call path. DeepSpeed removes the same two hooks itself while DeepCompile is active."""
    idle = (not engine.zero_optimization_partition_weights() and not engine.flops_profiler_enabled()
            and not engine.random_ltd_enabled() and not engine.fp16_auto_cast() and not engine.memory_breakdown()
            and not engine.autotuning_profile_model_info() and not engine.is_deepcompile_enabled()
            and not engine.engine_timers.forward_timers
            and not (engine.training_dataloader is None and engine.tput_timer.config.enabled))
    if not idle:
        return False
    for name in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(engine, name, None)
        if handle is not None:
            handle.remove()
            setattr(engine, name, None)
    return True


def forward_backward_add_nothing(engine: Any) -> bool:
    """Whether a DeepSpeed ``engine``'s ``forward`` and ``backward`` compute nothing beyond autocast around its
    module and ``(loss / gradient_accumulation_steps).backward()``, so the caller may run those directly.

    That holds at ZeRO-0 when the optimizer is the plain one (no ZeRO, fp16 or bf16 wrapper, no autocast
    GradScaler) and the gradients are not all-reduced after backward (one rank, where zerotrain's clip
    switches the identity reduction off). DeepSpeed (0.19.8) still wraps every forward in a context of its
    deep compiler, a hook on the output that runs its backward prologue, and every backward in lock-guarded
    counters, a graph tracker with its own hook, timers that are off and a memory report that is off: host
    time a small model's step waits for (its backward ~0.2 ms against ``loss.backward()`` and its forward
    ~0.1 ms more than the module's on a 2-core CPU, BENCHMARKS.md session 18). Its ``step`` (optimizer,
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
