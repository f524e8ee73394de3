"""The optimizer's GPU share under DeepSpeed's partial offload (ZeRO-3, ``offload_optimizer.ratio`` below 1).

DeepSpeed 0.19 keeps the first sub-groups' fp32 master weights, gradients and Adam moments on the GPU and steps
them there with a second optimizer of its own (``backup_optimizer``, torch's AdamW); the other sub-groups step on
the host through DeepSpeedCPUAdam. Two things a run relies on leave that second optimizer out, and this module
supplies them through the ZeRO-3 optimizer's attributes as 0.19.8 has them:

- its first parameter group is a copy of the host optimizer's, made when the engine was built, so the
  learning-rate schedule never reaches it (the other groups start as the host's own dicts, which a load may
  replace): :func:`follow_schedule` copies the hyper-parameters of every group over before each step;
- its moments are not in the checkpoint, which holds the host optimizer's state: :func:`lent_for_save` lends them
  to the host optimizer while the checkpoint is written (so a same-size resume and the universal checkpoint find
  them where they find the others), and :func:`take_loaded_states` moves them back after a load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""What the schedule and the config set in a parameter group, and AdamW reads."""


def gpu_masters(zero: Any) -> list[torch.Tensor]:
    """The fp32 master partitions that ``zero`` (DeepSpeed's ZeRO-3 optimizer) steps on the GPU; empty without a
    partial offload."""
    devices = getattr(zero, "subgroup_to_device", None)
    if getattr(zero, "backup_optimizer", None) is None or not devices:
        return []
    return [zero.fp32_partitioned_groups_flat[i] for i, device in sorted(devices.items()) if device != "cpu"]


def follow_schedule(zero: Any) -> None:
    """Give the GPU's optimizer the host optimizer's current hyper-parameters, group by group."""
    for host, gpu in zip(zero.optimizer.param_groups, zero.backup_optimizer.param_groups):
        for key in HYPERPARAMETERS:
            if key in host:
                gpu[key] = host[key]


@contextlib.contextmanager
def lent_for_save(zero: Any) -> Iterator[None]:
    """While inside, the host optimizer's state also holds the GPU share's moments (its step count as DeepSpeedCPUAdam
    keeps it, an int), so DeepSpeed's checkpoint writes them with the others."""
    lent = []
    for master in gpu_masters(zero):
        state = zero.backup_optimizer.state.get(master)
        if state:
            zero.optimizer.state[master] = {**state, "step": int(state["step"])}
            lent.append(master)
    try:
        yield
    finally:
        for master in lent:
            zero.optimizer.state.pop(master, None)


def take_loaded_states(zero: Any) -> None:
    """After a checkpoint was loaded into ``zero``: the GPU share's moments, which the load put into the host
    optimizer's state (on the GPU, beside their master weights), move to the GPU's optimizer, with the step count as
    a tensor as torch's AdamW keeps it."""
    for master in gpu_masters(zero):
        state = zero.optimizer.state.pop(master, None)
        if state:
            zero.backup_optimizer.state[master] = {
                **state, "step": torch.tensor(float(state["step"]), dtype=torch.float32)}
