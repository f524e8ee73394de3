"""ZeRO-1/2 with CPU optimizer offload: the gradient norm read to the host once a step, not once per tensor.

DeepSpeed (0.19.8) computes each gradient's norm on the GPU as the gradient is copied out, then sums
them on the host with one ``.item()`` per tensor in ``complete_grad_norm_calculation_for_cpu_offload``.
Every ``.item()`` waits for the GPU to drain, so the host cannot queue the next step's kernels: LoRA
on a 22-layer Llama (88 adapter tensors) made 188 host-device synchronisations a step, most of them
here. :func:`read_offload_norm_once` replaces that method on one optimizer instance with the same
sum (in float64, as DeepSpeed's Python floats are) done on the device, read once per parameter group
(zerotrain builds one).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerotrain.engines.ds_private.zero_clip import is_zero12
from zerotrain.engines.ds_private.zero_host import replace_method


def offload_norm_applies(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ZeRO-1/2 with its optimizer offloaded to the CPU."""

    return is_zero12(optimizer) and bool(getattr(optimizer, "cpu_offload", False))


def read_offload_norm_once(optimizer: Any) -> Callable[[], None]:
    """Give a ZeRO-1/2 CPU-offload ``optimizer`` the one-read norm; returns the undo (DeepSpeed's method again)."""

    return replace_method(optimizer, "complete_grad_norm_calculation_for_cpu_offload", _grad_norm)


def _grad_norm(self: Any, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """DeepSpeed's ``complete_grad_norm_calculation_for_cpu_offload`` with the per-tensor reads batched:
    the same tensors are counted (pipeline-replicated ones skipped, model-parallel rank 0 or
    model-parallel parameters), the same reductions run, and the result is the same CPU tensor."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter

    norms = []
    for p in params:
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            param_id = self.get_param_id(p)
            if param_id in self.norm_for_param_grads:
                norms.append(self.norm_for_param_grads[param_id])
            else:
                # DeepSpeed's own check: a trainable parameter whose gradient hook never ran
                assert self.ignore_unused_parameters, (
                    "a trainable parameter got no gradient (not used in the loss); set "
                    "zero_optimization.ignore_unused_parameters or use it")
    device = get_accelerator().current_device_name()
    # Summed where each norm lives (the GPU in DeepSpeed 0.19; a CPU norm would cost a copy each to move),
    # then one partial sum per device moved; float64 as DeepSpeed's Python floats are.
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_device.values():
        squares = squares + torch.stack(group).to(torch.float64).pow(2).sum().to(device)
    total = squares.float().reshape(1)  # DeepSpeed all-reduces a float32 tensor
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    norm = total[0].item() ** 0.5  # the one read
    if norm in (float("inf"), -float("inf")) or norm != norm:
        norm = -1.0
    return torch.tensor(norm, device=self.device, dtype=torch.float)
