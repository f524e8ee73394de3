"""DeepSpeed's own process groups with the job's collective timeout.

DeepSpeed builds the groups ZeRO reduces and gathers in (data-parallel, sequence-parallel, expert groups)
through its communication backend, whose ``new_group(ranks)`` calls ``torch.distributed.new_group(ranks)``
with no timeout. Those groups then take torch's default (30 minutes for Gloo, 10 for NCCL) rather than
``--launch.timeout_minutes``, which the world group has: a stopped rank held a job for 400+ seconds under a
one-minute timeout. Verified on DeepSpeed 0.16.0-0.19.8 (``deepspeed/comm/torch.py``, ``TorchBackend.new_group``).
Upstream, a ``timeout`` passed through ``deepspeed.comm.new_group`` (or groups inheriting the world group's)
would make this unnecessary.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch


def groups_time_out_after(minutes: float) -> Callable[[], None]:
    """Give the groups DeepSpeed creates from now on a timeout of ``minutes``; return the undo.

    The timeout goes on DeepSpeed's backend object (``deepspeed.comm.comm.cdb``, set by
    ``deepspeed.init_distributed``) as an instance method, which the undo deletes so that the class's own is
    found again; torch and DeepSpeed's modules are left as they are. Without an initialised backend
    (DeepSpeed not in use) it does nothing."""
    from deepspeed.comm import comm

    backend = comm.cdb
    if backend is None or not callable(getattr(backend, "new_group", None)):
        return lambda: None
    timeout = datetime.timedelta(minutes=minutes)

    def new_group(ranks):
        return torch.distributed.new_group(ranks, timeout=timeout)

    backend.new_group = new_group

    def undo() -> None:
        backend.__dict__.pop("new_group", None)

    return undo
