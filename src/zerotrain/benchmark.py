"""Sweep strategies over one recipe and write the speed/memory trade-off as JSON and a Markdown table.

Each strategy runs as its own ``zerotrain fit`` process, so peak-memory figures do not leak from
one run into the next; the figures come from each run's ``summary.json``, written by the same
:mod:`zerotrain.metrics` code that measures every training run.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zerotrain.errors import UserError
from zerotrain.rundir import environment, write_json
from zerotrain.strategies import STRATEGIES

COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("gpus", "world_size", "{}"),
    ("s/step", "throughput_sec_per_step", "{:.4f}"),
    ("tokens/s", "throughput_tokens_per_s", "{:,.0f}"),
    ("samples/s", "throughput_samples_per_s", "{:,.1f}"),
    ("TFLOP/s/GPU", "throughput_tflops_per_gpu", "{:.1f}"),
    ("MFU", "throughput_mfu", "{:.1%}"),
    ("data wait", "throughput_data_wait_frac", "{:.1%}"),
    ("peak GPU mem (GiB, rank 0)", "gpu_mem_peak_gib", "{:.2f}"),
    ("peak host RSS (GiB, rank 0)", "host_rss_peak_gib", "{:.2f}"),
]


def run_sweep(recipe: str, strategies: list[str], nprocs: list[int], out_dir: Path, fit_args: list[str],
              timeout_s: int = 3600) -> dict[str, Any]:
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in nprocs:
        for name in strategies:
            run_name = f"{recipe}-{name}-{n}gpu"
            cmd = [sys.executable, "-m", "zerotrain", "fit", recipe, *fit_args, *STRATEGIES[name].flags(),
                   "--launch.nproc_per_node", str(n), "--trainer.output_dir", str(out_dir / "runs"),
                   "--trainer.run_name", run_name, "--logging.progress_bar", "false"]
            print(f"[benchmark] {name} x {n}: {shlex.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            row: dict[str, Any] = {"strategy": name, "nproc": n, "wall_s": round(time.perf_counter() - t0, 1),
                                   "command": "zerotrain " + shlex.join(cmd[3:])}
            summary = out_dir / "runs" / run_name / "summary.json"
            if proc.returncode == 0 and summary.is_file():
                row.update(json.loads(summary.read_text()))
            else:
                tail = (proc.stderr or proc.stdout)[-4000:]
                row["error"] = _failure(tail)
                print(tail, file=sys.stderr)
            rows.append(row)
            print(f"[benchmark] {name} x {n}: {_brief(row)}", flush=True)
    result = {"recipe": recipe, "fit_args": fit_args, "command": " ".join(["zerotrain", *sys.argv[1:]]),
              "environment": environment(), "rows": rows}
    write_json(out_dir / "benchmark.json", result)
    (out_dir / "benchmark.md").write_text(markdown(result))
    return result


def _failure(log_tail: str) -> str:
    """One line saying why a fit failed: OOM, else zerotrain's own error line, else the last line."""
    if "out of memory" in log_tail.lower():
        return "out of memory"
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("zerotrain")]
    return (ours or lines or ["no output"])[-1][:300]


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    return ", ".join(f"{label}={fmt.format(row[key])}" for label, key, fmt in COLUMNS[2:5] if key in row)


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    gpus = env.get("gpus") or ["cpu"]
    lines = [
        f"### `{result['recipe']}` on {gpus[0]}" + (f" (x{len(gpus)} visible)" if len(gpus) > 1 else ""),
        "",
        f"Versions: torch {env['versions'].get('torch')}, deepspeed {env['versions'].get('deepspeed')}, "
        f"CUDA {env.get('cuda')}. Command: `{result['command']}`",
        "",
        "| " + " | ".join(label for label, _, _ in COLUMNS) + " | final metrics |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['strategy']} | {row['nproc']} | failed: {row['error']} |" + " |" * (len(COLUMNS) - 2))
            continue
        cells = [fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in COLUMNS]
        finals = ", ".join(f"{k}={row[k]:.4f}" for k in sorted(row) if k.startswith(("val_", "test_"))
                           and isinstance(row[k], float))
        lines.append("| " + " | ".join(cells) + f" | {finals} |")
    return "\n".join(lines) + "\n"
