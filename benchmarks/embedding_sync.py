"""Whether an embedding's backward makes the host wait for the GPU, and what that costs: torch's own against
zerotrain's ``TokenEmbedding``.

For each number of looked-up tokens and weight dtype: (1) the backward under torch's sync-debug "error" mode
(raises on a host-device synchronisation); (2) the host time of ``backward()`` issued behind ~20 ms of queued
GPU work: a backward that waits takes about that long, one that does not returns at once; (3) the two
gradients' largest difference.

    python benchmarks/embedding_sync.py --out OUT/embedding_sync.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from zerotrain.models.embedding import TokenEmbedding


def check(layer: nn.Embedding, ids: torch.Tensor, busy: torch.Tensor) -> dict:
    grad_out = torch.randn(*ids.shape, layer.embedding_dim, device=ids.device, dtype=layer.weight.dtype)
    for _ in range(2):  # warm-up: the first calls allocate
        layer.weight.grad = None
        layer(ids).backward(grad_out)
    torch.cuda.synchronize()
    layer.weight.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(ids).backward(grad_out)
        waits = False
    except RuntimeError as e:
        waits = "synchroniz" in str(e)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    layer.weight.grad = None
    out = layer(ids)
    for _ in range(20):  # about 1 ms of matmul each on an H100/H200
        busy = busy @ busy
        busy = busy / busy.norm()
    start = time.perf_counter()
    out.backward(grad_out)
    host_ms = 1000 * (time.perf_counter() - start)
    torch.cuda.synchronize()
    return {"waits_for_gpu": waits, "backward_host_ms_behind_queued_work": host_ms,
            "grad": layer.weight.grad.float().clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    # the queued work's own time, to read the host times against
    torch.cuda.synchronize()
    start = time.perf_counter()
    b = busy
    for _ in range(20):
        b = b @ b
        b = b / b.norm()
    torch.cuda.synchronize()
    queued_ms = 1000 * (time.perf_counter() - start)
    rows = []
    for tokens in (2048, 32 * 512, 32 * 1024):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            ids = torch.randint(0, 50265, (tokens // 512 if tokens >= 512 else 1, min(tokens, 512)), device=device)
            ids[0, :8] = 1  # some padding ids
            row = {"tokens": ids.numel(), "dtype": str(dtype).removeprefix("torch.")}
            grads = {}
            for name, cls in (("torch", nn.Embedding), ("zerotrain", TokenEmbedding)):
                torch.manual_seed(1)
                layer = cls(50265, 256, padding_idx=1).to(device=device, dtype=dtype)
                r = check(layer, ids, busy)
                grads[name] = r.pop("grad")
                row[name] = r
            row["max_abs_diff"] = (grads["torch"] - grads["zerotrain"]).abs().max().item()
            row["max_abs_grad"] = grads["torch"].abs().max().item()
            rows.append(row)
            print(json.dumps(row))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "queued_work_ms": queued_ms,
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"queued work alone: {queued_ms:.1f} ms")


if __name__ == "__main__":
    main()
