"""Private reads of DeepSpeed's engine, and the loads its ``load_checkpoint`` leaves unfinished, that zerotrain's
engine needs and the public API does not offer. They call DeepSpeed's private methods as 0.19.8 has them (the
release the NVMe and CPU-offload resume tests pass on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.weights import GatheredStateDict
from zerotrain.errors import UserError
from zerotrain.runtime.collectives import ask_others


def zero3_gathered_state_dict(engine: Any) -> GatheredStateDict:
    """The full 16-bit state dict of a ZeRO-3 ``engine``, each tensor gathered from every rank's partition when
    rank 0 reads it, so that the host holds what the writer holds (a shard), not the model, which DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict`` gathers whole. Every rank gets one: rank 0 reads it inside
    :func:`run_on_main`, whose other ranks call its ``serve`` with each name rank 0 gathers, and join that gather.

    Names and tied entries are the module's ``state_dict``'s; a parameter's full shape is ``ds_shape`` (DeepSpeed
    leaves an empty placeholder in ``shape``). Buffers, and the parameters DeepSpeed keeps whole on every rank
    (under its persistence threshold), are read as they are, without a collective; the others are gathered with
    ``deepspeed.zero.GatheredParameters`` and partitioned again once copied."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    entries = engine.module.state_dict(keep_vars=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def partitioned(t: torch.Tensor) -> bool:
        return hasattr(t, "ds_id") and not (getattr(t, "ds_persist", False)
                                            and t.ds_status == ZeroParamStatus.AVAILABLE)

    def gather(name: str) -> torch.Tensor | None:
        param = entries[name]
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().to("cpu", copy=True) if rank == 0 else None

    def read(name: str) -> torch.Tensor:
        t = entries[name]
        if not partitioned(t):
            return t.detach().to("cpu", copy=True)
        ask_others(name)
        return gather(name)

    specs = {k: (torch.Size(t.ds_shape) if hasattr(t, "ds_shape") else t.shape, t.dtype) for k, t in entries.items()}
    return GatheredStateDict(specs, read, serve=gather)


def load_nvme_offloaded_optimizer(engine: Any, load_dir: str, tag: str) -> bool:
    """Finish loading checkpoint ``load_dir/tag`` into a ZeRO-3 ``engine`` whose optimizer lives on NVMe, after
    ``engine.load_checkpoint`` has copied the checkpoint's swapped tensors into the swap folder (on every rank;
    False where DeepSpeed finds no partition files).

    DeepSpeed 0.19's ``load_checkpoint`` stops there under NVMe offload, and a resumed run then differs from one
    that never stopped: the swapper reads a sub-group's moments from disk only once it knows them, which it
    learns from the optimizer's state after a step, so the first step after a resume starts fresh zero moments;
    the sub-groups too small to swap (under DeepSpeed's minimum I/O size) keep their fp32 master weights and
    moments in memory, saved only in the partition file and never read back; and the 16-bit weights the forward
    pass reads are not refreshed from the masters, so that step runs on the weights as built. (Its own optimizer
    loader cannot be run instead: it leaves the swapped moments as the checkpoint's empty placeholders, and CPU
    Adam crashes on them.) Here, from the partition file: the optimizer's scalars (Adam's step count, the fp16
    loss scale) and the held sub-groups; each swapped moment gets a stand-in of its full size that owns no memory
    (the swapper sizes its reads by it), so that the next swap-in reads the copied file into it. Then, sub-group
    by sub-group as the optimizer's step does after its update, the masters are swapped in, copied into the
    16-bit weights (swapped out again where the weights live on NVMe too) and swapped out."""
    from deepspeed import comm as dist

    states = engine._get_all_zero_checkpoints(load_dir, tag)
    if states is None:
        return False
    opt = engine.optimizer
    saved = states[dist.get_rank(group=opt.dp_process_group)]
    opt.loss_scaler, opt.dynamic_loss_scale, opt.overflow = (saved[name] for name in (
        "loss_scaler", "dynamic_loss_scale", "overflow"))
    opt.optimizer_swapper.purge_state()  # forget any moments it knows: the loaded ones take their place
    opt._set_fp32_optimizer_param_groups()
    opt.optimizer.load_state_dict(saved["optimizer_state_dict"])
    opt._clear_fp32_optimizer_param_groups()
    for sub_group, master in enumerate(opt.fp32_partitioned_groups_flat):
        if opt._swappable_optimizer_subgroup(sub_group):
            numel = int(opt.fp16_partitioned_groups_flat_numel[sub_group])
            state = opt.optimizer.state[master]
            for name, value in state.items():
                if torch.is_tensor(value) and value.numel() == 0:  # saved while swapped out
                    state[name] = torch.empty(1, dtype=value.dtype).expand(numel)
    for master, kept in zip(opt.fp32_partitioned_groups_flat, saved["fp32_flat_groups"]):
        master.data.copy_(kept.data)  # held sub-groups; a swapped one is empty on both sides
    timers: set[str] = set()
    opt._partition_all_parameters()
    for sub_group in range(len(opt.fp16_groups)):
        opt._prepare_sub_group(sub_group, timers)
        opt._reassign_or_swap_out_partitioned_parameters(sub_group)
        opt._release_sub_group(sub_group, timers)
    opt._post_step(timers)
    return True


def check_nvme_checkpoint(engine: Any, folder: Path) -> None:
    """Refuse, in one line and before anything is copied, checkpoint ``folder`` for an ``engine`` whose optimizer
    lives on NVMe where its swapped files are not the ones this rank's optimizer would read.

    DeepSpeed names them by a count of the parameters built in the process (``<first>_<last>.tensor.swp``), so
    the checkpoint resumes in a process that builds the same model first, as it was built when the checkpoint was
    written. A process that built another ZeRO-3 model before (a notebook, a loop of fits), or a checkpoint written
    by one, does not match; nor does a checkpoint written without the optimizer on NVMe (no swapped files)."""
    missing = [name for name in swapped_master_files(engine) if not (folder / name).is_file()]
    if missing:
        raise UserError(f"--checkpoint.resume: {folder} lacks {missing[0]}, the NVMe-swapped fp32 weights this rank "
                        "would read. DeepSpeed names these files by a count of the parameters the process built, so "
                        "an NVMe checkpoint resumes only in a fresh process (a new `zerotrain fit`) and only if it "
                        "was written by one, with the same model and the optimizer on NVMe")


def swapped_master_files(engine: Any) -> list[str]:
    """The checkpoint-relative files that hold this rank's NVMe-swapped fp32 master weights, one per swapped
    sub-group, as DeepSpeed 0.19's ``save_checkpoint`` copies them
    (``offloaded_tensors/rank<NN>/<ds_id>.tensor.swp``)."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    opt = engine.optimizer
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    folder = f"offloaded_tensors/rank{dp_index_to_str(rank)}"
    return [f"{folder}/{master.ds_id}.tensor.swp" for sub_group, master in enumerate(opt.fp32_partitioned_groups_flat)
            if opt._swappable_optimizer_subgroup(sub_group)]


def replay_cpu_adam_steps(optimizer: Any) -> None:
    """Bring DeepSpeedCPUAdam's C++ step counter of a freshly loaded ``optimizer`` to the loaded step count, as a run
    that never stopped has it (nothing else: the call is made with empty tensors).

    DeepSpeed 0.19's C++ Adam keeps beta1^t and beta2^t beside its own step count, which no checkpoint holds. From one
    step to the next it multiplies them by the betas, in float32; for any other step it computes the powers afresh.
    A resumed optimizer starts at step 0, so its first step takes the powers while the uninterrupted run multiplied:
    pow(0.999, 3) and 0.999 * 0.999 * 0.999 differ by one float32 unit, which moves that step's update by about 1e-5
    of itself and the next step's loss (2.6e-6 on a tiny Llama resumed at step 2). Replaying the steps one by one takes
    the multiplying path every time: n calls that touch no data (about a second per million steps)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if type(optimizer) is not DeepSpeedCPUAdam:  # a subclass (ZenFlow's) may count its steps otherwise
        return
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    if not steps:
        return
    group, empty = optimizer.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    for step in range(1, max(steps) + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], empty, empty.clone(),
                                          empty.clone(), empty.clone())
