"""Every change zerotrain makes to DeepSpeed's own objects, each one declared, and applied only on the versions it was verified on.

A :class:`Patch` says what it changes, on which DeepSpeed releases its tests passed (``verified_versions``),
when it applies to a built engine, how it is undone, the measured gain that keeps it (on a published
workload; a patch that does not pay 3% of step time there is not kept) and the upstream change that would
make it unnecessary. :func:`apply_patches` applies those verified on the installed DeepSpeed; on any other
version none applies, one log line says so, and DeepSpeed's own code runs. Every patch changes one
instance (an optimizer or an engine): no module function or class attribute of DeepSpeed is replaced.
Figures cite BENCHMARKS.md; "IMDB (b)" is the tutorial's preset, whose step waits on the host.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from typing import Any, Callable, Iterable, Optional

from zerotrain.engines.ds_private import offload_norm, zero_clip, zero_host

log = logging.getLogger("zerotrain")

VERIFIED = ("0.19.8",)
"""The DeepSpeed releases every patch below was verified on (its tests pass there, bitwise where they compare)."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to a DeepSpeed object. ``apply`` changes ``target`` ("optimizer": ``engine.optimizer``, or
    "engine": DeepSpeed's engine) where ``applies`` holds, and returns the callable that undoes it."""

    name: str
    what: str
    target: str
    verified_versions: tuple[str, ...]
    applies: Callable[[Any], bool]
    apply: Callable[[Any], Callable[[], None]]
    gain: str
    upstream: str


def _nothing_to_undo(engine: Any) -> Callable[[], None]:
    return lambda: None


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="zero12_offload_norm_one_read",
        what="ZeRO-1/2 with CPU optimizer offload: complete_grad_norm_calculation_for_cpu_offload on the optimizer "
             "instance sums the per-tensor norms on the device and reads the total once, not once per tensor",
        target="optimizer", verified_versions=VERIFIED,
        applies=offload_norm.offload_norm_applies, apply=offload_norm.read_offload_norm_once,
        gain="LoRA 1.2B, ZeRO-2 + CPU offload, one H100, eager: 190.2 -> 157.3 ms a step (-17%; 88 host reads a "
             "step fewer; BENCHMARKS.md, LoRA against the Trainer, calls A and C)",
        upstream="DeepSpeed's complete_grad_norm_calculation_for_cpu_offload summing the norms as tensors and "
                 "reading the total once"),
    Patch(
        name="zero12_clip_without_sync",
        what="ZeRO-1/2: unscale_and_clip_grads on the optimizer instance takes the invalid-norm branch on the "
             "device (torch.where) instead of reading the norm to the host; bitwise DeepSpeed's gradients",
        target="optimizer", verified_versions=VERIFIED,
        applies=zero_clip.is_zero12, apply=zero_clip.clip_without_sync,
        gain="one host-device wait a step fewer (profile: one read fewer); measured together with the other "
             "ZeRO-1/2 step patches: IMDB (b)'s ZeRO-1 engine.step host time 2.09 ms against DeepSpeed's own "
             "6.92 ms on one H200 (BENCHMARKS.md, the one-group norm's host saving); its own share not isolated",
        upstream="DeepSpeed's unscale_and_clip_grads choosing the invalid-norm scale with torch.where"),
    Patch(
        name="zero12_one_rank_no_reduction",
        what="ZeRO-1/2 on one data-parallel rank where the reduction is the identity bit for bit: "
             "reduce_ready_partitions_and_remove_grads on the optimizer instance leaves each gradient in .grad, "
             "and ZeRO-2's per-tensor gradient hooks (_grad_acc_hooks) are removed (recreated on undo)",
        target="optimizer", verified_versions=VERIFIED,
        applies=zero_host.one_rank_reduction_is_identity, apply=zero_host.skip_one_rank_reduction,
        gain="IMDB (b), one H100, ZeRO-1: 15.94 -> 10.73 ms a step (-33%) with the one-launch norm, same call "
             "(BENCHMARKS.md, ZeRO-1/2 on one GPU without DeepSpeed's per-tensor host work, call 1)",
        upstream="DeepSpeed skipping gradient bucketing and its all-reduce when the data-parallel world size is 1"),
    Patch(
        name="zero12_norm_one_launch",
        what="ZeRO-1/2: get_grad_norm_direct on the optimizer instance takes the per-tensor float64 norms in one "
             "torch._foreach_norm, skips the all-reduce on one rank, and masks an inf/NaN norm to -1 without "
             "DeepSpeed's two host-device waits",
        target="optimizer", verified_versions=VERIFIED,
        applies=zero_host.norm_in_one_launch_applies, apply=zero_host.norm_in_one_launch,
        gain="IMDB (b), one H100, ZeRO-1: 15.94 -> 10.73 ms a step (-33%) with the one-rank reduction skipped "
             "(BENCHMARKS.md, call 1 of the same section); the wait-free mask: 2 x ZeRO-1 BERT-base 844,859 -> "
             "956,392 tokens/s (+13%) on 2 x H200 (BENCHMARKS.md, the norm mask was the step's drain)",
        upstream="DeepSpeed's get_grad_norm_direct using torch._foreach_norm, and mask_nan_or_inf_with_val_inplace "
                 "filling with a number"),
    Patch(
        name="zero12_one_group_norm",
        what="ZeRO-1/2 with one parameter group (no offload, MoE or Muon; DeepSpeed's own method otherwise): "
             "scaled_global_norm on the optimizer instance returns the group's norm where finite and inf where "
             "not, without the -1 mask and the combination of groups (16 small ops -> 4)",
        target="optimizer", verified_versions=VERIFIED,
        applies=zero_host.one_group_norm_applies, apply=zero_host.one_group_norm,
        gain="IMDB (b) on one H200: 0.48 ms less host time a ZeRO-1 step (2.09 against 2.57 ms, all 8 blocks), "
             "about 6% of its 7-8 ms host-bound step (BENCHMARKS.md, the one-group norm's host saving)",
        upstream="DeepSpeed's scaled_global_norm skipping combine_grad_norm_groups for a single group"),
    Patch(
        name="zero12_rebind_only_moved",
        what="ZeRO-1/2: _update_model_bit16_weights on the optimizer instance rebinds the 16-bit parameters to "
             "their slices of the flat buffer only when one has moved (DeepSpeed rebinds every one each step)",
        target="optimizer", verified_versions=VERIFIED,
        applies=zero_host.rebind_applies, apply=zero_host.rebind_only_moved_weights,
        gain="measured together with the one-rank reduction and the one-launch norm: IMDB (b), one H100, ZeRO-2 "
             "17.11 -> 9.45 ms a step (-45%; BENCHMARKS.md, call 2 of that section); its own share not isolated",
        upstream="DeepSpeed's _update_model_bit16_weights skipping parameters that already view the flat buffer "
                 "(its 'just to be safe' pass)"),
    Patch(
        name="zero0_direct_forward_backward",
        what="ZeRO-0 on one rank where DeepSpeed's forward and backward add only autocast and "
             "(loss / gradient_accumulation_steps).backward(): zerotrain's engine calls the module under the same "
             "autocast and runs that backward itself; DeepSpeed's objects are not changed (nothing to undo), "
             "and its step still runs",
        target="engine", verified_versions=VERIFIED,
        applies=zero_host.forward_backward_add_nothing, apply=_nothing_to_undo,
        gain="IMDB (b) on one H200: 0.286 ms less host time a step (median of 46 blocks, lower in 35), 4.5% of "
             "DeepSpeed's path's 6.39 ms, a step the GPU waits on (BENCHMARKS.md, ZeRO-0 runs DeepSpeed's "
             "forward and backward directly)",
        upstream="DeepSpeed's engine forward/backward skipping its compiler context, graph tracker and "
                 "lock-guarded counters when ZeRO, timers and profilers are off"),
    Patch(
        name="zero0_zero_grad_from_list",
        what="ZeRO-0: zero_grad on the engine instance sets .grad = None on a list of the module's parameters made "
             "once, where DeepSpeed walks module.named_parameters() every step",
        target="engine", verified_versions=VERIFIED,
        applies=zero_host.is_zero0, apply=zero_host.zero_grad_from_list,
        gain="with the idle forward hooks below: 0.13 ms less host time an IMDB (b) step on a 2-core CPU (about 2% "
             "of its 7.1 ms step on an H200); the two are not measured apart on a GPU "
             "(docs/benchmarks/restructure_ab_h200_202611.md)",
        upstream="DeepSpeed's engine caching its parameter list for zero_grad"),
    Patch(
        name="zero0_drop_idle_forward_hooks",
        what="ZeRO-0: the engine's forward pre- and post-hooks on its module are removed where every feature they "
             "serve (timers, flops profiler, random-LTD, fp16 input casting, ZeRO-3 marking) is off",
        target="engine", verified_versions=VERIFIED,
        applies=zero_host.forward_hooks_idle, apply=zero_host.drop_idle_forward_hooks,
        gain="measured together with the gradient list above (see there)",
        upstream="DeepSpeed registering its forward hooks only when a feature that needs them is on, as it "
                 "already does while DeepCompile is active"),
)


def installed_version() -> Optional[str]:
    """The installed DeepSpeed's version, from its package metadata (DeepSpeed is not imported); None if absent."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def patches_for(version: Optional[str], patches: Optional[Iterable[Patch]] = None) -> tuple[Patch, ...]:
    """The patches (:data:`PATCHES` by default) verified on DeepSpeed ``version`` (an exact release string: a
    local build such as ``0.19.8+abc`` may hold other code, so it gets none)."""
    return tuple(p for p in (PATCHES if patches is None else patches) if version in p.verified_versions)


def unverified_line(version: Optional[str], patches: Optional[Iterable[Patch]] = None) -> Optional[str]:
    """The one line said where no patch is verified on ``version``; None where some are."""
    patches = tuple(PATCHES if patches is None else patches)
    if not patches or patches_for(version, patches):
        return None
    verified = sorted({v for p in patches for v in p.verified_versions})
    return (f"DeepSpeed {version} is not among the versions zerotrain's optimisations were verified on "
            f"({', '.join(verified)}): running DeepSpeed's own code")


@dataclasses.dataclass
class Applied:
    """The patches applied to one engine, by name, and their undos."""

    names: list[str] = dataclasses.field(default_factory=list)
    undos: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def undo(self) -> None:
        """Undo every patch, the last applied first: DeepSpeed's own methods again."""
        while self.undos:
            self.undos.pop()()
        self.names.clear()


def apply_patches(engine: Any, version: Optional[str] = None, patches: Optional[Iterable[Patch]] = None) -> Applied:
    """Apply to DeepSpeed ``engine`` (and its optimizer) each patch verified on ``version`` (the installed
    DeepSpeed's by default) whose ``applies`` holds there. On a version none is verified on, nothing
    changes and one line says so."""
    version = installed_version() if version is None else version
    patches = tuple(PATCHES if patches is None else patches)
    line = unverified_line(version, patches)
    if line is not None:
        log.warning(line)
    applied = Applied()
    for patch in patches_for(version, patches):
        target = engine.optimizer if patch.target == "optimizer" else engine
        if patch.applies(target):
            applied.undos.append(patch.apply(target))
            applied.names.append(patch.name)
    return applied
