"""DeepSpeed's own process groups: the job's collective timeout on them, and their end with the job's group.

DeepSpeed builds the groups ZeRO reduces and gathers in (data-parallel, sequence-parallel, expert groups)
through its communication backend, whose ``new_group(ranks)`` calls ``torch.distributed.new_group(ranks)``
with no timeout. Those groups then take torch's default (30 minutes for Gloo, 10 for NCCL) rather than
``--launch.timeout_minutes``, which the world group has: a stopped rank held a job for 400+ seconds under a
one-minute timeout. Verified on DeepSpeed 0.16.0-0.19.8 (``deepspeed/comm/torch.py``, ``TorchBackend.new_group``).
Upstream, a ``timeout`` passed through ``deepspeed.comm.new_group`` (or groups inheriting the world group's)
would make this unnecessary.

DeepSpeed also keeps the groups it made (its copy of the world group, ZeRO's data-parallel group, expert and
sequence-parallel groups) in module globals of ``deepspeed.utils.groups``, for the life of the process.
:func:`destroy_process_groups` ends torch's groups so that those references go with them.
"""

from __future__ import annotations

import datetime
import sys
import time
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


SETTLE_S = 0.1
"""Seconds for the communication library's worker threads to free the last collective's tensors before a group
is destroyed (:func:`destroy_process_groups`)."""


def destroy_process_groups() -> None:
    """Destroy this process's torch.distributed groups, and DeepSpeed's references to them with them.

    ``torch.distributed.destroy_process_group`` alone leaves DeepSpeed's cached groups pointing at groups torch
    no longer knows, and the next ``deepspeed.initialize`` in this process (an in-process fit after a failed one,
    under the Python API or a test run) fails to broadcast the model: ``ValueError: Group ... is not
    registered``. ``deepspeed.comm.destroy_process_group`` destroys the world and drops those references
    (DeepSpeed 0.19.8 and later). Without DeepSpeed's backend (DeepSpeed not imported, or never initialised in
    this process) no DeepSpeed group exists and torch's own call does it; DeepSpeed is not imported for it.

    First the caller sleeps :data:`SETTLE_S` with the GIL released. A Gloo worker thread frees each finished
    collective's work after the caller has its result, and freeing a tensor whose Python object the work came to
    own takes the GIL. A group's destructor joins those threads with the GIL held: it runs here, or later when
    the last holder of the group goes (DDP's reducer). When it came before a worker thread had the GIL, the process
    hung after the run's last line (seen on torch 2.13 with two CPU ranks: the main thread in
    ``~ProcessGroupGloo`` joining, the worker in ``~AsyncBroadcastWork`` waiting for the GIL). The sleep lets the
    workers finish first; it narrows the race, which only torch can close.
    """
    time.sleep(SETTLE_S)
    comm = sys.modules.get("deepspeed.comm.comm")  # where DeepSpeed keeps its backend (cdb)
    if comm is not None and getattr(comm, "cdb", None) is not None:
        comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()
