"""Where a training step makes the host wait for the GPU: each call site, counted.

The profile summary counts host-device synchronisations per step but cannot say who made them.
This runs one zerotrain job with torch's CUDA sync-debug mode on "warn" and records the Python
stack of every synchronisation torch reports from inside ``Engine.train_step`` (reads of device
values, copies to the host, ``torch.cuda.synchronize``). Not seen: ``cudaEventSynchronize``, which
that mode does not report (the preemption agreement's one-step-late read), and syncs on threads
whose warnings do not reach Python's handler (printed by torch, not counted).

    torchrun --nproc_per_node 2 benchmarks/sync_sites.py OUT.json fit mlm --trainer.max_steps 30 ...

Each rank writes ``OUT.rank<r>.json``: per distinct stack (innermost frames first: up to four of
torch's, then up to six of the callers'), how many times it synchronised. Warm-up steps are included, so a
site seen once per step shows as about ``steps`` calls.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

SITES: Counter = Counter()
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep


def _record(message, category, filename, lineno, file=None, line=None):
    if "synchronizing" not in str(message).lower():
        return SHOW(message, category, filename, lineno, file, line)
    frames = traceback.extract_stack()[:-1]
    if not any(f.name == "train_step" and f.filename.endswith("engine.py") for f in frames):
        return  # outside the step: setup, logging, evaluation, checkpoints
    frames = [f for f in reversed(frames) if Path(f.filename).name != "warnings.py"]
    ours = [f for f in frames if not f.filename.startswith(TORCH_DIR)]
    inside = frames[:frames.index(ours[0])][:4] if ours else []  # torch's frames under the first of ours
    SITES[" <- ".join(_frame(f) for f in inside + ours[:6])] += 1


def _frame(f: traceback.FrameSummary) -> str:
    path = Path(f.filename)
    if f.filename.startswith(TORCH_DIR):
        return f"torch/{f.filename[len(TORCH_DIR):]}:{f.lineno} {f.name}"
    return f"{path.parent.name}/{path.name}:{f.lineno} {f.name}"  # deepspeed's runtime/engine.py vs ours


SHOW = warnings.showwarning


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    warnings.simplefilter("always", UserWarning)  # every occurrence, not the first per line
    warnings.showwarning = _record  # other warnings go on to the usual handler (SHOW)
    if torch.cuda.is_available():  # on CPU nothing synchronises: the job runs and finds no site
        torch.cuda.set_sync_debug_mode("warn")
    from zerotrain.cli import main as zerotrain_main

    os.environ.pop("TORCHELASTIC_RUN_ID", None)  # a finished worker would os._exit before the sites are written

    rc = zerotrain_main(argv)
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
    rank = int(os.environ.get("RANK", 0))
    sites = [{"calls": n, "stack": s} for s, n in SITES.most_common()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(f".rank{rank}.json").write_text(json.dumps({"argv": argv, "rc": rc, "sites": sites}, indent=1))
    for site in sites[:12]:
        print(f"rank {rank}: {site['calls']:5d}  {site['stack']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
