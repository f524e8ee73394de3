"""Who am I in the job, and how do the processes start.

zerotrain reads the environment the usual launchers write (torchrun, the ``deepspeed`` launcher,
SLURM's ``srun``) and, when started alone with ``--launch.nproc_per_node N``, starts the N
processes itself through torchrun's own library (``torch.distributed.run``). Nothing here
re-implements a rendezvous.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass

import torch

from zerotrain.config import LaunchConfig
from zerotrain.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def slurm_task_per_gpu(launch: LaunchConfig) -> bool:
    """Whether ``srun`` started one task per GPU (each task is a rank), rather than one launcher task per node.

    Several tasks on a node mean one per GPU. One task per node is a rank only when the user did
    not ask zerotrain to start more (``--launch.nproc_per_node 1``); otherwise it is a launcher.
    """
    if "SLURM_PROCID" not in os.environ:
        return False
    ntasks, nnodes = int(os.environ.get("SLURM_NTASKS", "1")), int(os.environ.get("SLURM_NNODES", "1"))
    return ntasks > 1 and (ntasks > nnodes or launch.nproc_per_node == 1)


def launched_by_a_launcher(launch: LaunchConfig) -> bool:
    """True inside a process started by torchrun/deepspeed (RANK set) or by srun as one task per GPU."""
    return "RANK" in os.environ or slurm_task_per_gpu(launch)


def adopt_slurm_env(launch: LaunchConfig) -> None:
    """Map SLURM's per-task variables onto torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Used when ``srun`` starts one task per GPU. The rendezvous address comes from
    ``--launch.rdzv_endpoint`` (set it to the first node of the allocation).
    """
    if "RANK" in os.environ or not slurm_task_per_gpu(launch):
        return
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"],
        WORLD_SIZE=os.environ.get("SLURM_NTASKS", "1"),
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", host),
        MASTER_PORT=os.environ.get("MASTER_PORT", port),
    )


def dist_info() -> DistInfo:
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comm_backend(requested: str, device: str) -> str:
    if requested == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if requested == "nccl" and device != "cuda":
        raise UserError("--launch.comm_backend nccl needs GPUs; on CPU use gloo (or auto)")
    if requested == "mpi" and not torch.distributed.is_mpi_available():
        raise UserError("--launch.comm_backend mpi: this PyTorch build has no MPI support; use auto")
    return requested


def init_process_group(backend: str, use_deepspeed: bool, device: str = "cpu", timeout_minutes: int = 60) -> DistInfo:
    """Initialise torch.distributed for this process (a group of one when started alone)."""
    if "RANK" not in os.environ:
        # A single process still gets a process group, so the engine code has one path.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    info = dist_info()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not torch.distributed.is_initialized():
        if use_deepspeed:
            # DeepSpeed picks its accelerator by itself (cuda when one is visible); a CPU run must say so
            # before deepspeed is imported, or the engine moves the model to the GPU behind our back.
            if backend == "gloo" and device == "cpu":
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=backend == "mpi", verbose=False,
                                       timeout=timeout)
        else:
            torch.distributed.init_process_group(backend=backend, timeout=timeout)
    return info


def spawn_local_workers(launch: LaunchConfig, argv: list[str]) -> int:
    """Re-run this command in ``nproc_per_node`` processes on this node through torchrun's library.

    Single node: torchrun's standalone mode picks a free port. Several nodes: a static rendezvous at
    ``rdzv_endpoint`` with this node's ``node_rank``, exactly as ``torchrun --nnodes --node-rank
    --master-addr --master-port`` would do.
    """
    from torch.distributed.run import get_args_parser, run

    args = [f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.nnodes == 1 and launch.rdzv_endpoint == LaunchConfig.rdzv_endpoint:
        args.append("--standalone")
    else:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        args += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}",
                 f"--master-addr={host}", f"--master-port={port}"]
    args += ["-m", "zerotrain", *argv]
    try:
        run(get_args_parser().parse_args(args))
    except Exception as exc:  # torchelastic's ChildFailedError lists each failed rank
        print(f"zerotrain: a worker process failed: {exc}", file=sys.stderr)
        return 1
    return 0


_ARCH = re.compile(r"^(\d+\.\d+)[a-z]?(\+PTX)?$")


def sanitize_cuda_arch_list() -> str | None:
    """Make ``TORCH_CUDA_ARCH_LIST`` parseable by DeepSpeed's op builder; return the old value if changed.

    Hopper images set ``9.0a``; DeepSpeed parses each entry as ``int(major)``/``int(minor)`` and fails
    with ``invalid literal for int() with base 10: '0a'`` when it JIT-builds FusedAdam or CPUAdam.
    Its kernels need nothing from the arch-specific ``a`` variant, so ``9.0`` builds the same ops.
    """
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    entries = re.split(r"[;\s]+", value.strip())
    fixed = []
    for entry in entries:
        m = _ARCH.match(entry)
        fixed.append(m.group(1) + (m.group(2) or "") if m else entry)
    new = ";".join(dict.fromkeys(fixed))
    if new == value:
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = new
    return value
