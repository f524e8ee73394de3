"""The named strategies that ``zerotrain benchmark`` sweeps and ``zerotrain estimate`` ranks.

A strategy fixes every memory-relevant field of ``--strategy`` (backend, ZeRO stage, both offloads),
so it means the same thing whatever a ``--config`` file says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from zerotrain.config import check_state_precision
from zerotrain.engines.states import Strategy
from zerotrain.errors import ConfigError, UserError

if TYPE_CHECKING:
    from zerotrain.config import RunConfig

# In the order the planner prefers them when they fit: fewer partitions before more, everything on
# the GPU before anything on the host. On one GPU ZeRO-3 never fits where ZeRO-2 does not (it only
# adds gathered layers), so the planner goes from ZeRO-2 to the offloads, the order BENCHMARKS.md
# measured on one H200. From two GPUs up, ZeRO-3 comes first: its all-gathers run on the GPU
# interconnect, while an offloaded optimizer step runs on the CPU (not measured here yet).
# ZeRO-3's parameter offload alone keeps the optimizer on the GPU and moves only the 16-bit weights to the
# host (2 bytes a parameter, copied up for each forward and backward pass): it comes before the optimizer
# offloads, whose CPU Adam step costs more than those copies. NVMe offload needs a disk the user names
# (--strategy.nvme_path): it is a candidate only then (:func:`available`).
# ZeRO-3's optimizer offload alone keeps the 16-bit weights on the GPU and pins its host gradients in blocks of
# ``sub_group_size`` elements, where ZeRO-1/2 pin each state as one block that PyTorch rounds up to a power of two:
# the same 18 bytes a parameter take less host memory pinned at 7B (119 GiB against 130; 113 unpinned either way).
# PyTorch's FSDP2 comes after DeepSpeed's stages, in its own order: resharding after each block's forward (ZeRO-3's
# memory), keeping the gathered copies until the backward pass (one all-gather fewer, the whole model's 16-bit
# copies held), then everything on the host. ``zerotrain estimate`` picks the first row that fits, so a
# DeepSpeed row where one fits; ``zerotrain plan`` and ``zerotrain benchmark`` try both families.
STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy("ddp"),
    "zero0": Strategy("deepspeed", 0),
    "zero1": Strategy("deepspeed", 1),
    "zero2": Strategy("deepspeed", 2),
    "zero3": Strategy("deepspeed", 3),
    "zero3_offload_param": Strategy("deepspeed", 3, offload_param="cpu"),
    "zero1_offload": Strategy("deepspeed", 1, offload_optimizer="cpu"),
    "zero2_offload": Strategy("deepspeed", 2, offload_optimizer="cpu"),
    "zero3_offload_optimizer": Strategy("deepspeed", 3, offload_optimizer="cpu"),
    "zero3_offload": Strategy("deepspeed", 3, offload_optimizer="cpu", offload_param="cpu"),
    "zero3_nvme": Strategy("deepspeed", 3, offload_optimizer="nvme", offload_param="nvme"),
    "fsdp2": Strategy("fsdp2"),
    "fsdp2_no_reshard": Strategy("fsdp2", reshard_after_forward=False),
    "fsdp2_offload": Strategy("fsdp2", offload_optimizer="cpu", offload_param="cpu"),
}


HOST_SHARES = tuple(round(1 - 0.05 * i, 2) for i in range(1, 20))
"""The shares of ZeRO-3's offloaded optimizer on the host (``--strategy.offload_optimizer_ratio``) that ``zerotrain
estimate`` and ``zerotrain plan`` try where nothing fits with all of it there, most on the host first."""


def may_share_optimizer(cfg: "RunConfig") -> bool:
    """Whether ``zerotrain estimate`` and ``zerotrain plan`` may try :data:`HOST_SHARES` for ``cfg``: it sets no share
    itself and no DeepSpeed file, and runs AdamW with fp32 master weights (what the split needs, see
    ``--strategy.offload_optimizer_ratio``)."""
    return (cfg.strategy.offload_optimizer_ratio == 1.0 and not cfg.strategy.deepspeed_config
            and cfg.optimizer.name == "adamw" and cfg.precision.master_weights == "fp32")


def offloads(strategy: Strategy) -> bool:
    """Whether ``strategy`` moves anything off the GPU (which needs a GPU to move it from)."""
    return strategy.offload_optimizer != "none" or strategy.offload_param != "none"


def available(cfg: "RunConfig", device: str = "cuda", precision: Optional[str] = None) -> dict[str, Strategy]:
    """The strategies a run of ``cfg`` can take on ``device`` (``precision``: what ``--precision.dtype`` resolves
    to there, where known), in :data:`STRATEGIES` order: no offload on the
    CPU, NVMe offload only with ``--strategy.nvme_path``, with bf16 master weights or optimizer states only
    those DeepSpeed runs them under (ZeRO 1-3, :func:`zerotrain.config.check_state_precision`), and FSDP2 only
    where it runs (:func:`fsdp2_runs`)."""
    return {name: s for name, s in STRATEGIES.items()
            if (device == "cuda" or not offloads(s))
            and (cfg.strategy.nvme_path or "nvme" not in (s.offload_optimizer, s.offload_param))
            and (s.backend != "fsdp2" or fsdp2_runs(cfg, precision))
            and _state_precision_runs(cfg, s)}


def fsdp2_runs(cfg: "RunConfig", precision: Optional[str] = None) -> bool:
    """Whether ``cfg`` can run under FSDP2: torch has ``fully_shard`` (2.6 on), the precision is not fp16, as
    written or as ``auto`` resolves (``precision``) on a GPU without bf16 (the engine refuses it there), and no
    DeepSpeed file of the user's sets the strategy."""
    import torch.distributed.fsdp as fsdp

    return (hasattr(fsdp, "fully_shard") and "fp16" not in (cfg.precision.dtype, precision)
            and not cfg.strategy.deepspeed_config)


def _state_precision_runs(cfg: "RunConfig", strategy: Strategy) -> bool:
    if cfg.precision.master_weights == "fp32" and cfg.precision.optimizer_states == "fp32":
        return True
    try:
        check_state_precision(strategy.apply(cfg))
    except ConfigError:
        return False
    return True


def parse_strategies(text: str, flag: str = "--strategies") -> list[str]:
    """The strategy names of a comma-separated ``text``, in order, each once. An empty list or item, a name twice
    (the sweep would run or rank the same candidate twice) or an unknown name is one line naming ``flag``."""
    names = [name.strip() for name in text.split(",")]
    if not text.strip() or "" in names:
        raise UserError(f"{flag}: {text!r} holds an empty name; pass comma-separated names such as zero2,fsdp2 "
                        f"(choose from {', '.join(STRATEGIES)})")
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        raise UserError(f"{flag}: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(f"{flag}: {', '.join(twice)} given more than once; name each strategy once (benchmark's "
                        "--rounds N repeats each fit)")
    return names
