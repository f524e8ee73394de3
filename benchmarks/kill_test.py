"""Kill -9 a training run at random moments, resume it each time, and check nothing was lost or damaged.

For each configuration (ZeRO-0/2/3 and the plain engine, the toy recipe on CPU, one process) it trains
an uninterrupted reference, then the same run killed ``--kills`` times with SIGKILL (at a random
moment after it has started training: inside steps, and inside checkpoint saves, which take a good
share of the time here because checkpoints are written often) and restarted with
``--checkpoint.resume auto`` after each kill, then let it finish. It writes, per configuration and in total:

* ``kills``: SIGKILLs sent (``kills_during_save``: of them, the ones that left an unfinished checkpoint folder);
* ``resumes_ok``: restarts that resumed from the newest intact checkpoint (or started fresh when there
  was none yet) and then trained, instead of failing;
* ``corrupt_checkpoints``: complete checkpoints (with ``COMPLETE.json``) whose files do not match the
  sizes and sha256 sums of their marker, checked after every kill;
* ``bitwise_equal``: whether the killed-and-resumed run logged the same loss at every step and exported
  the same weights, bit for bit, as the reference.

With ``--suites`` it also runs the other figures of benchmarks/kill_test_suites.py (signals, damaged checkpoints,
crafted pickles, links out of a run folder, full disks) and, in every case, writes ``FILE.md`` and ``FILE.png``
beside the JSON, with the versions, the commit and the command.

With ``--restarts`` it tests ``--launch.max_restarts`` instead: ``--kills`` runs of two processes (Gloo), each
started once with ``--launch.max_restarts 1``; in each, one worker (a random rank) is killed with SIGKILL at a
random moment of training (a random step, then a random delay within about one step, so inside steps and saves),
the launcher restarts both workers, and they resume from the last complete checkpoint by themselves. Per run:
whether it finished with status 0 after exactly one restart, the complete checkpoints that fail verification,
whether its losses and exported weights equal the uninterrupted reference's bit for bit, and the seconds from
the kill to the restarted workers' first trained step (read from the launcher's per-rank progress files). It
writes FILE (JSON), FILE with .md (a table) and .png (the recovery times).

Usage: python benchmarks/kill_test.py [--kills 8] [--configs zero0,zero2,zero3,ddp,zero2x2] [--suites all|none|a,b]
       [--out FILE] [--seed 0]
       python benchmarks/kill_test.py --restarts [--kills 20] [--configs zero2] [--max-steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from kill_test_suites import SUITES, run_suites, versions, write_outputs

CONFIGS = {
    "zero0": ["--strategy.zero_stage", "0"],
    "zero2": ["--strategy.zero_stage", "2"],
    "zero3": ["--strategy.zero_stage", "3"],
    "ddp": ["--strategy.backend", "ddp"],
    # Two processes (Gloo): the launcher and both workers are killed at once, as when the machine dies.
    "zero2x2": ["--strategy.zero_stage", "2", "--launch.nproc_per_node", "2"],
}
# Big enough that a checkpoint takes a measurable part of the run (so kills land in saves), small
# enough that a step takes milliseconds on one CPU core.
COMMON = ["--data.num_examples", "2048", "--data.dim", "128", "--model.width", "2048", "--trainer.max_steps", "300",
          "--trainer.micro_batch_size", "16", "--strategy.gradient_accumulation_steps", "2",
          "--trainer.log_every_steps", "1", "--trainer.eval_every_steps", "1000", "--trainer.num_workers", "0",
          "--checkpoint.every_steps", "3", "--checkpoint.keep_last", "2", "--logging.progress_bar", "false",
          "--logging.tensorboard", "false"]


def command(out_dir: Path, name: str, config: str, resume: bool) -> list[str]:
    args = [sys.executable, "-m", "zerotrain", "fit", "toy", *COMMON, *CONFIGS[config],
            "--trainer.output_dir", str(out_dir), "--trainer.run_name", name]
    return args + (["--checkpoint.resume", "auto"] if resume else [])


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train_loss" in row:
            out[row["step"]] = row["train_loss"]
    return out


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def rows_logged(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def check_checkpoints(run: Path) -> tuple[int, bool]:
    """(complete checkpoints that fail verification, whether an unfinished folder was left)."""
    from zerotrain.checkpoint.layout import complete_checkpoints, is_complete, problem

    ckpts = run / "checkpoints"
    corrupt = sum(problem(folder, checksums=True) is not None for folder in complete_checkpoints(ckpts))
    unfinished = ckpts.is_dir() and any(p.is_dir() and not is_complete(p) for p in ckpts.iterdir())
    return corrupt, unfinished


def kill_job(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (torchelastic starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    job, todo = [], [pid]
    while todo:
        job.append(todo.pop())
        todo += children.get(job[-1], [])
    for p in reversed(job):  # workers first, the launcher last
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_config(config: str, kills: int, work: Path, rng: random.Random) -> dict:
    env = environment()
    ref = subprocess.run(command(work, f"{config}-ref", config, False), env=env, capture_output=True, text=True)
    if ref.returncode != 0:
        raise SystemExit(f"{config}: the reference run failed:\n{ref.stderr[-3000:]}")
    run = work / f"{config}-killed"
    stats = {"kills": 0, "kills_during_save": 0, "resumes_ok": 0, "resumes": 0, "corrupt_checkpoints": 0,
             "bitwise_equal": False}
    failures = []
    while stats["kills"] < kills:
        from zerotrain.checkpoint.layout import complete_checkpoints

        newest = complete_checkpoints(run / "checkpoints")[-1:] if run.is_dir() else []
        proc = subprocess.Popen(command(work, run.name, config, True), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        resumed = stats["kills"] > 0
        start_rows = rows_logged(run)
        # Kill once it trains (it has logged a step past where it resumed), at a random moment after that.
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and rows_logged(run) <= start_rows:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:  # finished (or failed) before the kill
            err = proc.stderr.read()
            if proc.returncode != 0:
                failures.append(err[-2000:])
            if resumed:
                stats["resumes"] += 1
                stats["resumes_ok"] += proc.returncode == 0
            break
        kill_job(proc.pid)
        err = proc.communicate()[1]
        if resumed:
            stats["resumes"] += 1
            expected = f"resumed from {newest[0]}" if newest else "run directory"
            ok = expected in err and rows_logged(run) > 0
            stats["resumes_ok"] += ok
            if not ok:
                failures.append(err[-2000:])
        stats["kills"] += 1
        corrupt, unfinished = check_checkpoints(run)
        stats["corrupt_checkpoints"] += corrupt
        stats["kills_during_save"] += unfinished
    # The last restart runs to the end.
    final = subprocess.run(command(work, run.name, config, True), env=env, capture_output=True, text=True)
    stats["resumes"] += 1
    stats["resumes_ok"] += final.returncode == 0 and "resumed from" in final.stderr
    if final.returncode != 0:
        failures.append(final.stderr[-2000:])
    else:
        a, b = losses(work / f"{config}-ref"), losses(run)
        stats["bitwise_equal"] = a == b and same_weights(weights(work / f"{config}-ref"), weights(run))
    stats["failures"] = failures
    return stats


# --- --restarts: the launcher restarts the workers itself ------------------------------------------------

def restart_command(out_dir: Path, name: str, config: str, max_steps: int, restarts: int) -> list[str]:
    args = command(out_dir, name, config, False)
    return [*args, "--trainer.max_steps", str(max_steps), "--launch.nproc_per_node", "2",
            "--launch.max_restarts", str(restarts)]


def _step(folder: Path, rank: int) -> Optional[int]:
    """The step in a rank's progress file: None while blank (a restarted worker before it trains) or missing."""
    try:
        text = (folder / f"rank{rank}").read_text().split("\n")[0]
    except OSError:
        return None
    return int(text) if text.strip() else None


def _worker_pid(launcher: int, rank: int) -> Optional[int]:
    import psutil

    try:
        children = psutil.Process(launcher).children()
    except psutil.Error:
        return None
    for child in children:
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    return None


def restart_once(work: Path, config: str, index: int, max_steps: int, rng: random.Random) -> dict:
    """One run killed once (a random worker at a random moment); the launcher restarts it. What it found."""
    name, progress = f"{config}-restart{index:02d}", work / f"progress{index:02d}"
    env = {**environment(), "ZEROTRAIN_PROGRESS_DIR": str(progress)}
    err_path = work / f"{name}.stderr"
    rank, target = rng.randrange(2), rng.randint(1, max(1, max_steps - 8))
    row: dict = {"run": index, "killed_rank": rank, "kill_after_step": None, "kill_during_save": False,
                 "status": None, "restarts_said": 0, "seconds_kill_to_training": None}
    with open(err_path, "w") as err:
        proc = subprocess.Popen(restart_command(work, name, config, max_steps, 1), env=env, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline and (_step(progress, rank) or 0) < target:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment within the step (or the save) that follows
        pid = _worker_pid(proc.pid, rank)
        if proc.poll() is None and pid is not None:
            row["kill_after_step"] = _step(progress, rank)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            row["kill_during_save"] = check_checkpoints(work / name)[1]
            # The restarted rank 0 blanks its step, writes the step it resumed at, then the steps it trains.
            seen_blank, resumed_at = False, None
            while proc.poll() is None and time.monotonic() < deadline:
                step = _step(progress, 0)
                if step is None:
                    seen_blank = True
                elif seen_blank and resumed_at is None:
                    resumed_at = step
                elif seen_blank and step > resumed_at:
                    row["seconds_kill_to_training"] = round(time.monotonic() - killed_at, 2)
                    break
                time.sleep(0.01)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = err_path.read_text()
    row["status"] = proc.returncode
    row["restarts_said"] = sum(line.startswith("zerotrain: restart ") for line in stderr.splitlines())
    row["restart_line"] = next((line for line in stderr.splitlines() if line.startswith("zerotrain: restart ")), None)
    row["corrupt_checkpoints"] = check_checkpoints(work / name)[0]
    row["failure"] = None if proc.returncode == 0 else stderr[-2000:]
    return row


def run_restarts(config: str, kills: int, max_steps: int, work: Path, rng: random.Random, jobs: int,
                 deadline: Optional[float]) -> dict:
    """The reference, then ``kills`` runs killed once each, ``jobs`` at a time; stops starting runs at ``deadline``."""
    from concurrent.futures import ThreadPoolExecutor

    seeds = [rng.randrange(2**31) for _ in range(kills)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ref = pool.submit(subprocess.run, restart_command(work, f"{config}-ref", config, max_steps, 0),
                          env=environment(), capture_output=True, text=True)
        futures = []
        for i, seed in enumerate(seeds):
            if deadline is not None and time.time() > deadline:
                break
            futures.append(pool.submit(restart_once, work, config, i, max_steps, random.Random(seed)))
            # Start a run only when a slot is free, so that the deadline is checked against real progress.
            while sum(not f.done() for f in futures) >= jobs:
                time.sleep(0.5)
        rows = [f.result() for f in futures]
        ref = ref.result()
    if ref.returncode != 0:
        raise SystemExit(f"{config}: the reference run failed:\n{ref.stderr[-3000:]}")
    reference = work / f"{config}-ref"
    for row in rows:
        run = work / f"{config}-restart{row['run']:02d}"
        row["bitwise_equal"] = (row["status"] == 0 and losses(run) == losses(reference)
                                and same_weights(weights(run), weights(reference)))
    times = sorted(r["seconds_kill_to_training"] for r in rows if r["seconds_kill_to_training"] is not None)
    summary = {
        "runs": len(rows),
        "kills": sum(r["kill_after_step"] is not None for r in rows),
        "kills_during_save": sum(r["kill_during_save"] for r in rows),
        "finished": sum(r["status"] == 0 for r in rows),
        "one_restart_line": sum(r["restarts_said"] == 1 for r in rows),
        "corrupt_checkpoints": sum(r["corrupt_checkpoints"] for r in rows),
        "bitwise_equal": sum(r["bitwise_equal"] for r in rows),
        "seconds_kill_to_training_median": times[len(times) // 2] if len(times) % 2 else
        (round((times[len(times) // 2 - 1] + times[len(times) // 2]) / 2, 2) if times else None),
        "seconds_kill_to_training_max": max(times) if times else None,
    }
    return {"summary": summary, "runs": rows}


def write_restart_pages(report: dict, out: Path) -> None:
    """FILE.md (a table per configuration) and FILE.png (seconds from each kill to training again)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"# {report['what']}", "", f"Command: `{report['command']}`", ""]
    for config, result in report["configs"].items():
        s = result["summary"]
        lines += [f"## {config}", "", "| runs | kills | during a save | finished (status 0) | one restart line | "
                  "corrupt checkpoints | bitwise equal | kill to training, median s | max s |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| {s['runs']} | {s['kills']} | {s['kills_during_save']} | {s['finished']} | {s['one_restart_line']} "
                  f"| {s['corrupt_checkpoints']} | {s['bitwise_equal']} | {s['seconds_kill_to_training_median']} | "
                  f"{s['seconds_kill_to_training_max']} |", "",
                  "| run | killed rank | after step | during a save | status | bitwise equal | kill to training, s |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['run']} | {r['killed_rank']} | {r['kill_after_step']} | {'yes' if r['kill_during_save'] else 'no'} "
                  f"| {r['status']} | {'yes' if r['bitwise_equal'] else 'no'} | {r['seconds_kill_to_training']} |"
                  for r in result["runs"]]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for config, result in report["configs"].items():
        rows = [r for r in result["runs"] if r["seconds_kill_to_training"] is not None]
        ax.bar([f"{r['run']}" for r in rows], [r["seconds_kill_to_training"] for r in rows],
               color=["tab:orange" if r["kill_during_save"] else "tab:blue" for r in rows], label=config)
    ax.set_xlabel("run (orange: killed during a checkpoint save)")
    ax.set_ylabel("seconds, kill to first step trained again")
    ax.set_title("--launch.max_restarts 1: SIGKILL of one of 2 workers (CPU, Gloo)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main_restarts(args, rng: random.Random) -> int:
    results = {}
    deadline = time.time() + args.budget_minutes * 60 if args.budget_minutes else None
    with tempfile.TemporaryDirectory(prefix="zerotrain-restart-test-") as tmp:
        for config in args.configs.split(","):
            t0 = time.monotonic()
            results[config] = run_restarts(config, args.kills, args.max_steps, Path(tmp), rng, args.jobs, deadline)
            results[config]["seconds"] = round(time.monotonic() - t0, 1)
            print(config, results[config]["summary"], flush=True)
    report = {"what": "--launch.max_restarts 1, one worker of 2 killed with SIGKILL at a random moment; toy recipe, "
                      "CPU, Gloo",
              "command": " ".join(["python", "benchmarks/kill_test.py", *sys.argv[1:]]),
              "versions": versions(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "configs": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    write_restart_pages(report, out)
    s = [r["summary"] for r in results.values()]
    ok = all(x["finished"] == x["runs"] == x["bitwise_equal"] == x["kills"] and x["corrupt_checkpoints"] == 0
             for x in s)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=8, help="SIGKILLs per configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--out", default="kill_test.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--suites", default="none", help="the other figures: all, none, or comma-separated of "
                        + ", ".join(SUITES))
    parser.add_argument("--restarts", action="store_true",
                        help="test --launch.max_restarts: 2 workers, one killed per run, restarted by the launcher")
    parser.add_argument("--max-steps", type=int, default=40, help="with --restarts: steps of each run")
    parser.add_argument("--jobs", type=int, default=1, help="with --restarts: runs at a time")
    parser.add_argument("--budget-minutes", type=float, default=0,
                        help="with --restarts: start no run after this many minutes (0: no limit)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if args.restarts:
        if args.configs == ",".join(CONFIGS):
            args.configs = "zero2"
        return main_restarts(args, rng)
    results = {}
    with tempfile.TemporaryDirectory(prefix="zerotrain-kill-test-") as tmp:
        for config in filter(None, args.configs.split(",")):
            t0 = time.monotonic()
            results[config] = run_config(config, args.kills, Path(tmp), rng)
            results[config]["seconds"] = round(time.monotonic() - t0, 1)
            print(config, {k: v for k, v in results[config].items() if k != "failures"}, flush=True)
            write_report(Path(args.out), results, {})  # what finished so far, should a long run be stopped
    names = list(SUITES) if args.suites == "all" else [n for n in args.suites.split(",") if n and n != "none"]
    return 0 if write_report(Path(args.out), results, run_suites(names) if names else {}) else 1


def write_report(out: Path, results: dict, suites: dict) -> bool:
    """Write ``out`` (JSON), ``out.md`` and ``out.png``; whether every figure held."""
    total = {key: sum(r[key] for r in results.values())
             for key in ("kills", "kills_during_save", "resumes", "resumes_ok", "corrupt_checkpoints")}
    total["bitwise_equal"] = all(r["bitwise_equal"] for r in results.values())
    report = {"what": "kill -9 at random moments, then --checkpoint.resume auto; toy recipe, CPU, 1 and 2 processes",
              "command": " ".join(["python", "benchmarks/kill_test.py", *sys.argv[1:]]),
              "versions": versions(), "total": total, "configs": results}
    ok = total["resumes_ok"] == total["resumes"] and total["corrupt_checkpoints"] == 0 and total["bitwise_equal"]
    if suites:
        report["suites"] = suites
        ok = ok and all(s["passed"] == s["total"] for s in suites.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    write_outputs(report, out)
    print("total", total, flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
