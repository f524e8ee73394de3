"""Bandwidth of the collectives a data-parallel ZeRO-1/2 step runs, on this machine's GPUs.

ZeRO-1 on two H200s (session 20) spent 2.26 ms a step in one bf16 all-reduce of BERT-base's gradients
(~220 MB), in NCCL's ring kernel with the LL protocol. This times all-reduce, reduce-scatter and
all-gather of that size, so the profile's figure can be set against what the link gives, and under
``NCCL_PROTO`` settings passed in the environment.

    torchrun --nproc_per_node 2 benchmarks/allreduce_bw.py OUT.json [--mib 212] [--iters 20]

Bus bandwidth as nccl-tests defines it: all-reduce moves 2(n-1)/n of the buffer per rank, reduce-scatter
and all-gather (n-1)/n.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--mib", type=float, default=212.0, help="buffer size (BERT-base's bf16 gradients: ~212 MiB)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    numel = int(args.mib * 2**20 / 2) // n * n
    full = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(numel // n, device="cuda", dtype=torch.bfloat16)
    size = numel * 2
    rows = {}
    for name, fn, factor in (
        ("all_reduce", lambda: dist.all_reduce(full), 2 * (n - 1) / n),
        ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, full), (n - 1) / n),
        ("all_gather", lambda: dist.all_gather_into_tensor(full, part), (n - 1) / n),
    ):
        s = timed(fn, args.iters)
        rows[name] = {"ms": s * 1e3, "bus_gb_per_s": factor * size / s / 1e9}
    if rank == 0:
        result = {"gpus": n, "gpu": torch.cuda.get_device_name(), "buffer_mib": size / 2**20, "dtype": "bf16",
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "torch": torch.__version__,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
