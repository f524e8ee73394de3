"""DeepSpeed's CPU Adam: seconds a step over N fp32 parameters, on PyTorch's default CPU thread count and on one.

    python3 benchmarks/cpu_adam_threads.py 1e9

Prints each count's three step times (the first left out: the first of all allocates the moments), then one JSON line with
the best of the last two. CPU Adam's OpenMP threads are the calling thread's, which ``torch.set_num_threads``
sets. Needs DeepSpeed's CPU Adam op (``zerotrain doctor --build`` builds it) and about 16 bytes of host memory
a parameter.
"""
import json
import sys
import time

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

n = int(float(sys.argv[1])) if len(sys.argv) > 1 else int(1e9)
default = torch.get_num_threads()
chunk = 100_000_000
params = [torch.nn.Parameter(torch.randn(min(chunk, n - i))) for i in range(0, n, chunk)]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt = DeepSpeedCPUAdam(params, lr=1e-4)
out = {"params": n, "default_threads": default}
for threads in (default, 1, default):
    torch.set_num_threads(threads)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    out[f"s_per_step_{threads}_threads"] = min(times[1:])
    print(threads, times, flush=True)
print(json.dumps(out))
