"""Sweep strategies over one recipe and write the speed/memory trade-off as JSON and a Markdown table.

Each strategy runs as its own ``zerotrain fit`` process, so peak-memory figures do not leak from
one run into the next; the figures come from each run's ``summary.json``, written by the same
:mod:`zerotrain.metrics.meters` code that measures every training run.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterator, Optional

from zerotrain.config import upgrade_layout
from zerotrain.config.flags import parse_config
from zerotrain.errors import OOM_EXIT, UserError
from zerotrain.plan.estimate import estimate
from zerotrain.plan.probe import Probe, run_probe
from zerotrain.plan.strategies import STRATEGIES
from zerotrain.runtime.rundir import environment, write_json
from zerotrain.tasks import registry as recipes

if TYPE_CHECKING:
    from zerotrain.plan.probe import Probe

COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("gpus", "world_size", "{}"),
    ("s/step", "throughput_sec_per_step", "{:.4f}"),
    ("tokens/s (non-padding)", "tokens_per_s", "{:,.0f}"),
    ("samples/s", "throughput_samples_per_s", "{:,.1f}"),
    ("TFLOP/s/GPU", "throughput_tflops_per_gpu", "{:.1f}"),
    ("MFU", "throughput_mfu", "{:.1%}"),
    ("data wait", "throughput_data_wait_frac", "{:.1%}"),
    ("loop thread on CPU (rank 0)", "throughput_host_cpu_frac", "{:.0%}"),
    ("backward thread on CPU (rank 0)", "throughput_host_backward_cpu_frac", "{:.0%}"),
    ("Python GC (ms/step, rank 0)", "throughput_host_gc_ms_per_step", "{:.2f}"),
    ("Python GC (ms/step, all ranks added)", "throughput_gc_ms_per_step_all_ranks", "{:.2f}"),
    ("peak GPU mem (GiB, rank 0)", "gpu_mem_peak_gib", "{:.2f}"),
    ("peak host RSS (GiB, rank 0)", "host_rss_peak_gib", "{:.2f}"),
    ("predicted GPU (GiB)", "predicted_gpu_mem_gib", "{:.2f}"),
    ("predicted host (GiB)", "predicted_host_mem_gib", "{:.2f}"),
    ("family", "family", "{}"),
]


def run_one(recipe: str, fit_args: list[str], runs_dir: Path, run_name: str, timeout_s: int = 3600,
            env: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One ``zerotrain fit`` in its own process; its summary plus :func:`_standard_fields` as one row.

    A failed fit is a row too (``status`` oom / failed + its first line), not an exception: an
    out-of-memory is one of the answers a sweep or a plan is looking for."""
    env = env or environment()
    cmd = [sys.executable, "-m", "zerotrain", "fit", recipe, *fit_args, "--trainer.output_dir", str(runs_dir),
           "--trainer.run_name", run_name, "--logging.progress_bar", "false"]
    t0, started = time.perf_counter(), time.time()
    returncode, out, err, timed_out = run_bounded(cmd, timeout_s, spool=runs_dir / f"{run_name}.output")
    tail, log = (err or out)[-4000:], out + err
    if timed_out:
        tail = f"timed out after {timeout_s} s: {err[-2000:]}"
    # started_unix: when the fit began, to line up rows of benchmarks that ran side by side (benchmarks/tax_square.py)
    row: dict[str, Any] = {"started_unix": round(started, 3), "wall_s": round(time.perf_counter() - t0, 1),
                           "command": "zerotrain " + shlex.join(cmd[3:])}
    run_dir = runs_dir / run_name
    try:  # what the fit said, kept beside its summary (appended: a rerun into the same folder adds its own)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "fit.log", "a") as f:
            f.write(f"$ {row['command']}\n{log}")
    except OSError as exc:  # a folder the fit could not write either: the row says why the fit failed
        print(f"[benchmark] could not keep the fit's log: {exc}", file=sys.stderr)
    summary = run_dir / "summary.json"
    if returncode == 0 and summary.is_file():
        row.update(json.loads(summary.read_text()))
    else:
        # -1 is run_bounded's mark of a timeout, not a signal: the tail already says it timed out
        row["error"] = "out of memory" if returncode == OOM_EXIT else _failure(tail, None if timed_out else returncode)
        print(tail, file=sys.stderr)
    row["nproc"] = row.get("world_size") or _nproc(fit_args)
    row.update(_standard_fields(recipe, row, run_dir, env))
    return row


STOP_GRACE_S = 30
"""How long a timed-out fit and its workers get, after SIGTERM, before SIGKILL."""


def run_bounded(cmd: list[str], timeout_s: float, grace_s: float = STOP_GRACE_S,
                spool: Optional[Path] = None) -> tuple[int, str, str, bool]:
    """Run ``cmd``; (return code, -1 where it timed out; stdout; stderr; whether it timed out).

    A fit of several processes is a launcher whose workers run in process groups of their own (torchelastic
    starts them so): killing the launcher alone, as ``subprocess.run``'s timeout does, leaves them
    running, holding their GPUs and the rendezvous port while the next trial starts. On a timeout, or
    when this process is interrupted, the whole tree gets SIGTERM, then SIGKILL after ``grace_s``.
    The output goes to files, not pipes, so a process that outlives its parent cannot hold the read open.

    ``spool``: those files go to a new folder ``<spool>.<random>`` (``stdout``, ``stderr``) instead of the temp
    folder, removed once they are read. A sweep ended from outside (Ctrl-C, a job's deadline, a kill) leaves it,
    holding what the fit had said: the only account of a fit stopped mid-step. Where it cannot be created, the
    temp folder serves, and the fit reports the folder it cannot write.
    """
    with _output_files(spool) as (out, err):
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_process_tree(proc.pid, grace_s)
        except BaseException:  # Ctrl-C, or a time limit's signal to this sweep: the fit must not outlive it
            stop_process_tree(proc.pid, grace_s)
            raise
        proc.wait()  # already reaped by psutil where it was stopped: its code then reads 0, so -1 stands for it
        out.seek(0)
        err.seek(0)
        return -1 if timed_out else proc.returncode, out.read(), err.read(), timed_out


@contextlib.contextmanager
def _output_files(spool: Optional[Path]) -> Iterator[tuple[IO[str], IO[str]]]:
    """stdout and stderr files for :func:`run_bounded`: in a new folder named after ``spool``, which stays where
    the block ends by an exception, else anonymous temp files."""
    folder = None
    if spool is not None:
        try:
            spool.parent.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(dir=spool.parent, prefix=f"{spool.name}."))
        except OSError:
            folder = None
    if folder is None:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            yield out, err
        return
    with open(folder / "stdout", "w+") as out, open(folder / "stderr", "w+") as err:
        yield out, err
    shutil.rmtree(folder, ignore_errors=True)


def stop_process_tree(pid: int, grace_s: float) -> None:
    """SIGTERM to ``pid`` and every process below it (found before the first signal: a launcher that
    exits first would leave its workers to init), SIGKILL to those still alive ``grace_s`` later."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _nproc(fit_args: list[str]) -> int:
    """Processes of the job the flags describe (per node x nodes), for a row whose run left no summary."""
    def flag(name: str) -> int:
        for i, arg in enumerate(fit_args):
            if arg == name and i + 1 < len(fit_args):
                return int(fit_args[i + 1])
            if arg.startswith(name + "="):
                return int(arg.split("=", 1)[1])
        return 1

    return flag("--launch.nproc_per_node") * flag("--launch.nnodes")


def _probe(recipe: str, fit_args: list[str], out_dir: Path) -> tuple[Optional["Probe"], Optional[str]]:
    """The memory model's measurements for this sweep's workload (one probe serves every row), or why not."""

    try:  # a config the probe cannot take is reported by each fit's own row, not here
        cfg = parse_config(recipe, fit_args)
        per_rank = cfg.trainer.micro_batch_size * cfg.strategy.gradient_accumulation_steps
        return run_probe(recipe, fit_args, out_dir / "probe.json", per_rank,
                         checkpointing=cfg.activation_checkpointing.enabled), None
    except UserError as exc:
        return None, str(exc)


def predicted(recipe: str, fit_args: list[str], strategy: str, probe: "Probe") -> dict[str, Any]:
    """The memory model's peak GPU and host memory (rank 0) for the run ``fit_args`` describe, whose
    strategy flags are those of ``strategy``."""

    cfg = parse_config(recipe, fit_args)
    pred = estimate(recipe, cfg, probe=probe).predictions[strategy]  # type: ignore[index]
    return {**pred.as_row(), "predicted_activations": pred.activations}


def _predicted_or_why(recipe: str, fit_args: list[str], strategy: str, probe: Optional["Probe"],
                      no_probe: Optional[str]) -> dict[str, Any]:
    if probe is not None:
        try:
            return predicted(recipe, fit_args, strategy, probe)
        except Exception as exc:  # noqa: BLE001  (a failed prediction must not cost the rows already measured)
            no_probe = f"{type(exc).__name__}: {exc}"
    return {"predicted_gpu_mem_gib": None, "predicted_host_mem_gib": None, "predicted_activations": no_probe}


def read_probe(path: Path) -> "Probe":
    """A probe file written earlier (``python -m zerotrain.plan.probe``, or a plan's or sweep's probe.json)."""

    try:
        return Probe.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"--probe {path}: not a probe file ({type(exc).__name__}: {exc}); pass the probe.json "
                        "that `python -m zerotrain.plan.probe` or an earlier sweep wrote, or leave --probe out") from None


def run_sweep(recipe: str, strategies: list[str], nprocs: list[int], out_dir: Path, fit_args: list[str],
              timeout_s: int = 3600, profile_steps: int = 0, predict: bool = True,
              probe_file: Optional[Path] = None, rounds: int = 1) -> dict[str, Any]:
    """One fit per strategy and process count. With ``predict`` the memory model's peaks go next to the
    measured ones in each row: one probe (:mod:`zerotrain.plan.probe`, a few seconds) before the first fit, or
    ``probe_file``, one taken earlier of the same workload on the same GPU kind (a big model's probe takes
    minutes). The files are rewritten after every row: a sweep cut short keeps the rows it finished.

    ``rounds`` > 1 runs every fit that many times, the strategies in reverse order every other round (a
    drift over the sweep, a warmer machine, then falls on both sides of each pair), and adds
    :func:`round_summary`: a host-bound step moves more between runs than the few per cent two engines
    differ by, so one run per strategy cannot tell them apart."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"--strategies: unknown {unknown}; choose from {', '.join(STRATEGIES)}")
    short = recipes.name_of(recipes.get(recipe))  # run folder names: a module:Class spec holds a colon
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    if probe_file is not None:
        probe, no_probe = read_probe(probe_file), None
    else:
        probe, no_probe = _probe(recipe, fit_args, out_dir) if predict else (None, "not asked (--predict false)")
    if no_probe:
        print(f"[benchmark] no memory predictions: {no_probe}", flush=True)
    extra = ["--trainer.profile_steps", str(profile_steps)] if profile_steps else []
    rows: list[dict[str, Any]] = []
    result = {"recipe": recipe, "fit_args": fit_args, "command": " ".join(["zerotrain", *sys.argv[1:]]),
              "environment": env, "probe": str(probe_file) if probe_file else ("probe.json" if probe else None),
              "rows": rows}
    for rnd, n, name in _fit_order(strategies, nprocs, rounds):
        suffix = f"-r{rnd}" if rounds > 1 else ""
        run_name = f"{short}-{name}-{n}gpu{suffix}"
        args = [*fit_args, *STRATEGIES[name].flags(), *extra, "--launch.nproc_per_node", str(n)]
        print(f"[benchmark] {name} x {n}{suffix}: zerotrain fit {recipe} {shlex.join(args)}", flush=True)
        row = {"strategy": name, "family": STRATEGIES[name].family,
               **run_one(recipe, args, out_dir / "runs", run_name, timeout_s, env)}
        if rounds > 1:
            row["round"] = rnd
        row.update(_predicted_or_why(recipe, args, name, probe, no_probe))
        run_dir = out_dir / "runs" / run_name
        if (run_dir / "profile.md").is_file():
            row["profile"] = json.loads((run_dir / "profile.json").read_text())
            (out_dir / f"profile_{name}_{n}gpu{suffix}.md").write_text((run_dir / "profile.md").read_text())
        rows.append(row)
        print(f"[benchmark] {name} x {n}{suffix}: {_brief(row)}", flush=True)
        if rounds > 1:
            result["rounds"] = round_summary(rows)
        write_json(out_dir / "benchmark.json", result)
        (out_dir / "benchmark.md").write_text(markdown(result))
    plot(result, out_dir / "benchmark.png")
    return result


def _fit_order(strategies: list[str], nprocs: list[int], rounds: int) -> list[tuple[int, int, str]]:
    """(round, processes, strategy) in the order the fits run: every other round reversed (ABBA)."""
    order = []
    for rnd in range(1, rounds + 1):
        one = [(n, name) for n in nprocs for name in strategies]
        order += [(rnd, n, name) for n, name in (one if rnd % 2 else one[::-1])]
    return order


def round_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per strategy and process count over the rounds that ran ok: the median, fastest and slowest s/step,
    and the tax against the baseline of the same process count (the plain engine ``ddp`` where it ran,
    else the first strategy) as the median of the rounds' own ratios. A round's ratio pairs two fits run
    back to back, so the machine's drift over the sweep cancels in it as it does not across rounds."""
    import statistics

    ok = [r for r in rows if r.get("status") == "ok" and r.get("throughput_sec_per_step")]
    by: dict[tuple[str, int], dict[int, float]] = {}
    for r in ok:
        by.setdefault((r["strategy"], r["n_gpus"]), {})[r.get("round", 1)] = r["throughput_sec_per_step"]
    out = []
    for (name, n), times in by.items():
        base_name = "ddp" if ("ddp", n) in by else next(s for s, m in by if m == n)
        base = by[(base_name, n)]
        paired = [times[k] / base[k] - 1 for k in sorted(times) if k in base]
        values = list(times.values())
        out.append({
            "strategy": name, "n_gpus": n, "rounds_ok": len(values),
            "sec_per_step_median": statistics.median(values), "sec_per_step_min": min(values),
            "sec_per_step_max": max(values), "spread": max(values) / min(values) - 1,
            "baseline": base_name,
            "tax_median": statistics.median(paired) if paired and name != base_name else None,
            "tax_min": min(paired) if paired and name != base_name else None,
            "tax_max": max(paired) if paired and name != base_name else None,
        })
    return out


def _standard_fields(recipe: str, row: dict[str, Any], run_dir: Path, env: dict[str, Any]) -> dict[str, Any]:
    """The fields every result row carries, whatever the recipe (None where a failed run left none)."""
    hparams = json.loads((run_dir / "hparams.json").read_text()) if (run_dir / "hparams.json").is_file() else {}
    error = row.get("error")
    samples = row.get("throughput_samples_per_s")
    return {
        "recipe": recipe, "model": hparams.get("model"), "n_params": row.get("n_params"),
        "gpu": row.get("device") or (env.get("gpus") or ["cpu"])[0], "n_gpus": row.get("world_size", row["nproc"]),
        "precision": row.get("precision") or upgrade_layout(hparams).get("precision", {}).get("dtype"),
        "micro_batch_size": row.get("micro_batch_size") or hparams.get("trainer", {}).get("micro_batch_size"),
        # Mean padded length of a sample: the positions the model computed per example.
        "seq_len": row["throughput_tokens_per_s"] / samples if samples else None,
        "tokens_per_s": row.get("throughput_real_tokens_per_s"), "mfu": row.get("throughput_mfu"),
        "peak_gpu_mem_gib": row.get("gpu_mem_peak_gib"), "peak_host_mem_gib": row.get("host_rss_peak_gib"),
        "status": "ok" if error is None else ("oom" if error == "out of memory" else f"failed: {error}"),
        "commit": env.get("commit"),
    }


def plot(result: dict[str, Any], path: Path) -> Optional[Path]:
    """tokens/s against peak GPU memory, one point per strategy and GPU count, coloured and marked by engine family
    (DeepSpeed ZeRO, FSDP2, PyTorch DDP) with a legend (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[benchmark] matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    ok = [r for r in result["rows"] if r["status"] == "ok" and r.get("tokens_per_s")]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    families = sorted({_family(r) for r in ok})
    styles = dict(zip(families, zip(("tab:blue", "tab:orange", "tab:green", "tab:red"), ("o", "s", "^", "D"))))
    for r in ok:
        mem = r.get("peak_gpu_mem_gib") or r.get("peak_host_mem_gib") or 0.0
        color, marker = styles[_family(r)]
        ax.scatter(mem, r["tokens_per_s"], color=color, marker=marker)
        ax.annotate(f"{_label(r)} x{r['n_gpus']}", (mem, r["tokens_per_s"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    gpu = ok[0]["gpu"] if ok else "no successful run"
    ax.set_xlabel("peak GPU memory, rank 0 (GiB)" if any(r.get("peak_gpu_mem_gib") for r in ok)
                  else "peak host memory, rank 0 (GiB)")
    ax.set_ylabel("tokens/s (non-padding, whole job)")
    ax.set_title(f"{result['recipe']} on {gpu}", fontsize=10)
    ax.grid(alpha=0.3)
    for family in families:  # one legend entry per family
        ax.scatter([], [], color=styles[family][0], marker=styles[family][1], label=family)
    if families:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _failure(log_tail: str, returncode: Optional[int] = None) -> str:
    """One line saying why a fit failed: OOM, else a kill by a signal, else zerotrain's own error line, else the
    last line. A fit killed by SIGKILL printed nothing of its own, and its last line is whatever it said before:
    most often the kernel's out-of-memory killer ended it when host memory ran out (an offload's host states)."""
    if "out of memory" in log_tail.lower() or "out of gpu memory" in log_tail.lower():
        return "out of memory"
    if returncode == -signal.SIGKILL or returncode == 128 + signal.SIGKILL:
        return ("killed by SIGKILL with no error of its own: most often the kernel's out-of-memory killer, when host "
                "memory runs out (dmesg says); an offload needs less host memory unpinned "
                "(--strategy.offload_pin_memory false) or with bf16 states")
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("zerotrain")]
    return (ours or lines or ["no output"])[-1][:300]


def _family(row: dict[str, Any]) -> str:
    """The row's engine family (a row of an older sweep has none: its strategy's)."""
    return row.get("family") or (STRATEGIES[row["strategy"]].family if row.get("strategy") in STRATEGIES else "other")


def _label(row: dict[str, Any]) -> str:
    """The strategy, and the round of a sweep with ``rounds`` > 1."""
    return row["strategy"] + (f" r{row['round']}" if "round" in row else "")


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    # A fit that ended within its warm-up steps has no throughput: the row holds None for it
    shown = [f"{label}={fmt.format(row[key])}" for label, key, fmt in COLUMNS[2:5] if row.get(key) is not None]
    return ", ".join(shown) or "no timed steps (every step was within --trainer.warmup_steps_excluded)"


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
        name = _label(row)
        if "error" in row:
            lines.append(f"| {name} | {row['nproc']} | failed: {row['error']} |" + " |" * (len(COLUMNS) - 2))
            continue
        cells = [name] + [fmt.format(row[key]) if row.get(key) is not None else "-" for _, key, fmt in COLUMNS[1:]]
        finals = ", ".join(f"{k}={row[k]:.4f}" for k in sorted(row) if k.startswith(("val_", "test_"))
                           and isinstance(row[k], float))
        lines.append("| " + " | ".join(cells) + f" | {finals} |")
    if result.get("rounds"):
        lines += _rounds_markdown(result["rounds"], max(r.get("round", 1) for r in result["rows"]))
    return "\n".join(lines) + "\n"


def _rounds_markdown(summary: list[dict[str, Any]], rounds: int) -> list[str]:
    def pct(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:+.1%}"

    lines = ["", f"Over {rounds} rounds, every other one in reverse order (the rows above carry their round):", "",
             "| strategy | gpus | rounds ok | median s/step | fastest - slowest | spread | tax, median of rounds "
             "(lowest, highest) |", "|---|---|---|---|---|---|---|"]
    for g in summary:
        tax = ("baseline" if g["strategy"] == g["baseline"]
               else f"{pct(g['tax_median'])} vs {g['baseline']} ({pct(g['tax_min'])}, {pct(g['tax_max'])})")
        lines.append(f"| {g['strategy']} | {g['n_gpus']} | {g['rounds_ok']} | {g['sec_per_step_median']:.4f} | "
                     f"{g['sec_per_step_min']:.4f} - {g['sec_per_step_max']:.4f} | {g['spread']:.1%} | {tax} |")
    return lines
