"""Host memory of a CPU-offloaded fit whose data-loader workers fork before the engine exists (zerotrain since
session 19) or after it (before), measured on this machine.

A worker forked after the engine shares the engine's host pages; each page the training process writes later (the
offloaded optimizer rewrites its fp32 master weights and gradients every step) is then copied. On a GPU host that
took a 5.46B model's unpinned ZeRO-2 offload from ~92 to over 125 GiB (BENCHMARKS.md, session 19). Here the same
mechanism at a size a CPU runs: the toy MLP made wide, ZeRO-2 with the optimizer offloaded (DeepSpeedCPUAdam), two
workers, a few steps. Each order runs in its own process; this one samples the proportional set size (PSS: a page
shared by n processes counts 1/n in each) of that process and its children every 0.1 s, so the sum is the memory
the run really holds, shared pages once.

    python benchmarks/fork_memory.py --out benchmarks/results/cpu/session19_fork_memory [--width 4194304]

Writes ``fork_memory.json`` and ``fork_memory.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

RUN = """
import sys
from zerotrain.data.loader import _StopSignalSafeLoader
from zerotrain.train.loop import fit
from zerotrain.tasks.toy import ToyConfig, ToyTask

order, width, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if order == "after":  # the order before session 19: the workers fork at the first batch, after the engine
    _StopSignalSafeLoader.start_workers = lambda self: None
cfg = ToyConfig()
cfg.model.width = width
cfg.data.num_examples = 512
cfg.trainer.micro_batch_size = 8
cfg.trainer.max_steps = steps
cfg.trainer.num_workers = 2
cfg.trainer.evaluate = False
cfg.trainer.export = False
cfg.trainer.output_dir = out
cfg.trainer.run_name = order
cfg.checkpoint.save_final = False
cfg.logging.progress_bar = False
cfg.logging.tensorboard = False
cfg.strategy.zero_stage = 2
cfg.strategy.offload_optimizer = "cpu"
fit(ToyTask(cfg))
"""


def tree_pss(root: psutil.Process) -> int:
    """PSS of ``root`` and its live descendants, in bytes (0 for any that ended meanwhile)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def measure(order: str, width: int, steps: int, out: Path) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", RUN, order, str(width), str(steps), str(out / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak, samples = 0, 0
    while proc.poll() is None:
        try:
            peak = max(peak, tree_pss(root))
            samples += 1
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    log = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"the {order} run failed (exit {proc.returncode}):\n{log[-3000:]}")
    return {"order": order, "peak_pss_gib": peak / 2**30, "samples": samples, "log_tail": log.splitlines()[-3:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=4_194_304, help="the toy MLP's hidden width (17 x width parameters)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(order, args.width, args.steps, args.out) for order in ("before", "after", "before", "after")]
    params = 17 * args.width + 8
    from zerotrain.runtime.rundir import environment

    result = {"command": " ".join(["python", *sys.argv]), "parameters": params, "rows": rows,
              "cpu": f"{psutil.cpu_count()} cores", "host_gib": psutil.virtual_memory().total / 2**30,
              "environment": environment()}
    (args.out / "fork_memory.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Peak host memory (PSS of the run's processes) by when the loader workers fork, on a CPU",
             "", f"Toy MLP, {params:,} parameters, ZeRO-2 with CPU optimizer offload (fp32), 2 workers, "
             f"{args.steps} steps; `{result['command']}`", "",
             f"Commit {result['environment'].get('commit')}, torch {result['environment']['versions'].get('torch')}, "
             f"DeepSpeed {result['environment']['versions'].get('deepspeed')}, {result['cpu']}, {result['host_gib']:.0f} GiB host.", "",
             "| workers fork | peak PSS (GiB) |", "|---|---|"]
    lines += [f"| {r['order']} the engine | {r['peak_pss_gib']:.2f} |" for r in rows]
    (args.out / "fork_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
