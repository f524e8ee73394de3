"""The named strategies that ``zerotrain benchmark`` sweeps and ``zerotrain estimate`` ranks.

A strategy fixes every memory-relevant field of ``--strategy`` (backend, ZeRO stage, both offloads),
so it means the same thing whatever a ``--config`` file says.
"""

from __future__ import annotations

from zerotrain.engines.states import Strategy

# In the order the planner prefers them when they fit: fewer partitions before more, everything on
# the GPU before anything on the host. On one GPU ZeRO-3 never fits where ZeRO-2 does not (it only
# adds gathered layers), so the planner goes from ZeRO-2 to the offloads, the order BENCHMARKS.md
# measured on one H200. From two GPUs up, ZeRO-3 comes first: its all-gathers run on the GPU
# interconnect, while an offloaded optimizer step runs on the CPU (not measured here yet).
STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy("ddp"),
    "zero0": Strategy("deepspeed", 0),
    "zero1": Strategy("deepspeed", 1),
    "zero2": Strategy("deepspeed", 2),
    "zero3": Strategy("deepspeed", 3),
    "zero1_offload": Strategy("deepspeed", 1, offload_optimizer="cpu"),
    "zero2_offload": Strategy("deepspeed", 2, offload_optimizer="cpu"),
    "zero3_offload": Strategy("deepspeed", 3, offload_optimizer="cpu", offload_param="cpu"),
}
