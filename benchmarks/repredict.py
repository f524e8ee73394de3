"""A plan's trials, or a benchmark's rows, against the memory model of today's code, from a probe of the
same workload.

    python benchmarks/repredict.py PLAN_OR_BENCHMARK.json PROBE.json [OUT.json] [-- EXTRA FIT FLAGS]

EXTRA FIT FLAGS are added to the file's own: a file from before a default changed is predicted as it ran (the
H200 sweeps of sessions 1-2 ran DeepSpeed's defaults: ``-- --strategy.fast_path false``).

The plan file keeps what each trial measured (a ``zerotrain benchmark`` file, each row); the probe file (``python -m zerotrain.plan.probe``, or a plan
folder's probe.json) holds what the memory model reads. Every trial's peak GPU and host memory is
predicted again with the current :func:`zerotrain.plan.planner.assess`, so a change to the memory model can
be checked against trials already run. Use a probe taken on the same GPU kind as the trials (the
file names the GPU); the paths in the plan's ``fit_args`` must exist here (the tokenizer sets the
vocabulary). Prints a Markdown table; writes it as JSON too when OUT is given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zerotrain.plan.benchmark import predicted
from zerotrain.config.flags import parse_config
from zerotrain.plan.memory import GIB
from zerotrain.plan.planner import Candidate, assess
from zerotrain.plan.probe import Probe
from zerotrain.plan.strategies import STRATEGIES


def _pct(predicted: float, measured: float | None) -> str:
    return f"{100 * (predicted / measured - 1):+.0f}%" if measured else "-"


def repredict(plan_path: Path, probe_path: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    plan = json.loads(plan_path.read_text())
    plan["fit_args"] = [*plan["fit_args"], *extra]
    probe = Probe.from_dict(json.loads(probe_path.read_text()))
    if "summary" not in plan:
        return _repredict_benchmark(plan, probe)
    if probe.device_name != plan["summary"]["gpu"]:
        raise SystemExit(f"{probe_path} was taken on {probe.device_name}, the trials on {plan['summary']['gpu']}")
    cfg = parse_config(plan["recipe"], plan["fit_args"])
    cfg.trainer.export = False  # the trials ran without it (planner.TRIAL_FLAGS)
    if cfg.trainer.max_steps is None and cfg.trainer.epochs is None:
        cfg.trainer.max_steps = 1  # the run's length changes no prediction; validate() wants one (as plan() does)
    trialled = [row for row in plan["rows"] if (row.get("measured") or {}).get("status") == "ok"]
    cands = [Candidate(row["strategy"], row["micro_batch_size"], row["grad_accum"], row["activation_checkpointing"],
                       row.get("offload_pin_memory") is False) for row in trialled]
    assessed = assess(plan["recipe"], cfg, probe, cands, host_bytes=float("inf"))
    return [{"trial": row["candidate"], "predicted_then_gpu_gib": row["predicted_gpu_mem_gib"],
             "predicted_now_gpu_gib": new.memory.gpu_bytes / GIB, "measured_gpu_gib": row["measured"]["peak_gpu_mem_gib"],
             "predicted_now_host_gib": new.memory.host_bytes / GIB,
             "measured_host_gib": row["measured"]["peak_host_mem_gib"]}
            for row, new in zip(trialled, assessed)]


def _first(row: dict, *keys: str):
    """The first of ``keys`` that ``row`` has a value for (older files name the measured peaks differently)."""
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _repredict_benchmark(result: dict, probe: Probe) -> list[dict]:
    """The rows of a ``zerotrain benchmark`` file that ran, predicted again (each row's own fit flags)."""
    rows = []
    for row in result["rows"]:
        # Files from before the standard row fields (sessions 1-2) name the same things differently.
        if row.get("status", "failed" if row.get("error") else "ok") != "ok":
            continue
        gpu = row.get("gpu") or row.get("device")
        if probe.device_name != gpu:
            raise SystemExit(f"the probe was taken on {probe.device_name}, the row {row['strategy']} ran on {gpu}")
        n_gpus = row.get("n_gpus") or row.get("world_size") or row.get("nproc") or 1
        # The row's own flags, as `zerotrain benchmark` ran it (its strategy on its process count)
        args = [*result["fit_args"], *STRATEGIES[row["strategy"]].flags(), "--launch.nproc_per_node", str(n_gpus)]
        now = predicted(result["recipe"], args, row["strategy"], probe)
        cfg = parse_config(result["recipe"], args)
        micro = row.get("micro_batch_size") or cfg.trainer.micro_batch_size
        accum = row.get("grad_accum") or cfg.strategy.gradient_accumulation_steps
        rows.append({"trial": f"{row['strategy']} micro {micro} x {accum}" + (f" on {n_gpus} GPUs" if n_gpus > 1 else ""),
                     "predicted_then_gpu_gib": row.get("predicted_gpu_mem_gib"),
                     "predicted_now_gpu_gib": now["predicted_gpu_mem_gib"],
                     "measured_gpu_gib": _first(row, "peak_gpu_mem_gib", "gpu_mem_peak_gib"),
                     "predicted_now_host_gib": now["predicted_host_mem_gib"],
                     "measured_host_gib": _first(row, "peak_host_mem_gib", "host_rss_peak_gib")})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| trial | predicted then (GiB) | predicted now (GiB) | measured (GiB) | error now | predicted host now "
           "| measured host | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        then = r["predicted_then_gpu_gib"]
        then = f"{then:.2f} ({_pct(then, r['measured_gpu_gib'])})" if then is not None else "-"
        out.append(f"| {r['trial']} | {then} "
                   f"| {r['predicted_now_gpu_gib']:.2f} | {r['measured_gpu_gib']:.2f} "
                   f"| {_pct(r['predicted_now_gpu_gib'], r['measured_gpu_gib'])} | {r['predicted_now_host_gib']:.2f} "
                   f"| {r['measured_host_gib']:.2f} | {_pct(r['predicted_now_host_gib'], r['measured_host_gib'])} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    argv, extra = (sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]) if "--" in sys.argv \
        else (sys.argv[1:], [])
    found = repredict(Path(argv[0]), Path(argv[1]), tuple(extra))
    print(markdown(found))
    if len(argv) > 2:
        Path(argv[2]).write_text(json.dumps({"plan": argv[0], "probe": argv[1], "extra_fit_args": extra, "rows": found},
                                            indent=1))
