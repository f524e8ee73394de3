"""The named strategies that ``zerotrain benchmark`` sweeps and ``zerotrain estimate`` ranks.

A strategy fixes every memory-relevant field of ``--strategy`` (backend, ZeRO stage, both offloads),
so it means the same thing whatever a ``--config`` file says.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerotrain.config import RunConfig


@dataclass(frozen=True)
class Strategy:
    backend: str  # "deepspeed" or "ddp"
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def flags(self) -> list[str]:
        """The ``zerotrain fit`` flags that select this strategy."""
        return ["--strategy.backend", self.backend, "--strategy.zero_stage", str(self.zero_stage),
                "--strategy.offload_optimizer", self.offload_optimizer, "--strategy.offload_param", self.offload_param]

    def apply(self, cfg: "RunConfig") -> "RunConfig":
        """A copy of ``cfg`` running this strategy, offloads included (a user's --strategy.offload_param
        does not carry over to ZeRO-1)."""
        cfg = copy.deepcopy(cfg)
        s = cfg.strategy
        s.backend, s.zero_stage = self.backend, self.zero_stage
        s.offload_optimizer, s.offload_param = self.offload_optimizer, self.offload_param
        return cfg


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
