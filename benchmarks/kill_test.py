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

Usage: python benchmarks/kill_test.py [--kills 8] [--configs zero0,zero2,zero3,ddp,zero2x2] [--suites all|none|a,b]
       [--out FILE] [--seed 0]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=8, help="SIGKILLs per configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--out", default="kill_test.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--suites", default="none", help="the other figures: all, none, or comma-separated of "
                        + ", ".join(SUITES))
    args = parser.parse_args()
    rng = random.Random(args.seed)
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
