"""IMDB preset (b) against the tutorial's Lightning script, both rows in one result file.

Reads a finished ``zerotrain fit imdb`` run folder (``metrics.jsonl``, ``summary.json``) and the log of
the DeepSpeed tutorial's Lightning script for IMDB (not shipped here; its ``SEED_RESULT`` line), run one after the other on the
same GPU, and writes ``OUT.json``, ``OUT.md`` and ``OUT.png`` (time per batch and per epoch, peak GPU
memory, accuracy), with the GPU, versions, commit and both commands.

    python benchmarks/imdb_vs_lightning.py --run RUN_DIR --lightning_log LOG --out PREFIX \\
        --zerotrain_command "..." --lightning_command "..."

Training time per epoch: zerotrain's from its 50-step windows (benchmarks/epoch_times.py); Lightning's
script prints only its mean time per batch after the first 20 batches and the wall time of the whole fit
(validation included), so its epoch's training time is that mean times its batches.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from epoch_times import epoch_seconds

from zerotrain.runtime.rundir import environment


def lightning_row(log: Path) -> dict:
    line = next((ln for ln in log.read_text().splitlines() if ln.startswith("SEED_RESULT")), None)
    if line is None:
        return {"name": "tutorial Lightning script", "status": f"failed: no SEED_RESULT line in {log}"}
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    batches, per_batch = int(fields["batches"]), float(fields["s_per_batch"])
    return {"name": "tutorial Lightning script", "status": "ok", "ms_per_batch": 1000 * per_batch,
            "epoch_train_s": [per_batch * batches], "best_epoch_train_s": per_batch * batches,
            "wall_s": float(fields["wall_s"]), "peak_gpu_mem_gib": float(fields["peak_gib"]),
            "accuracy": float(fields["val_acc"]), "accuracy_of": "its validation after 1 epoch (25,000 test reviews)"}


def zerotrain_row(run: Path, steps_per_epoch: int) -> dict:
    name = "zerotrain preset (b)"
    if not (run / "summary.json").is_file() or not (run / "metrics.jsonl").is_file():
        return {"name": name, "status": f"failed: no summary.json or metrics.jsonl in {run}"}
    summary = json.loads((run / "summary.json").read_text())
    epochs, _ = epoch_seconds(run / "metrics.jsonl", steps_per_epoch)
    if not epochs:
        return {"name": name, "status": f"failed: {run} logged no whole epoch"}
    best = min(epochs)
    return {"name": name, "status": "ok", "engine": summary.get("engine"),
            "ms_per_batch": 1000 * best / steps_per_epoch, "ms_per_batch_first_epoch": 1000 * epochs[0] / steps_per_epoch,
            "epoch_train_s": epochs, "best_epoch_train_s": best,
            "ms_per_batch_whole_run": 1000 * summary["throughput_sec_per_step"],
            "peak_gpu_mem_gib": summary["gpu_mem_peak_gib"], "accuracy": summary.get("test_acc"),
            "accuracy_of": f"test, {summary.get('test_reviews')} reviews, after {len(epochs)} epochs"}


def markdown(result: dict) -> str:
    env = result["environment"]
    out = [f"# IMDB (b): zerotrain against the tutorial's Lightning script, {', '.join(env['gpus']) or 'cpu'}", "",
           f"commit {env['commit']}, torch {env['versions']['torch']}, deepspeed {env['versions']['deepspeed']}", "",
           "| run | ms per batch (zerotrain: its best epoch; Lightning: after 20 batches) | training time per epoch (s) "
           "| peak GPU GiB | accuracy |",
           "|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            out.append(f"| {r['name']} | {r['status']} | | | |")
            continue
        epochs = ", ".join(f"{t:.1f}" for t in r["epoch_train_s"])
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        out.append(f"| {r['name']} | {r['ms_per_batch']:.1f} | {epochs} | {r['peak_gpu_mem_gib']:.2f} | "
                   f"{accuracy} ({r['accuracy_of']}) |")
    out += ["", "Commands:", ""] + [f"- `{c}`" for c in result["commands"]]
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if r["status"] == "ok"]
    if not ok:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.0, 3.6))
    names = [r["name"] for r in ok]
    left.bar(names, [r["best_epoch_train_s"] for r in ok], color=["tab:blue", "tab:orange"][: len(ok)])
    left.axhline(10.0, color="grey", linestyle="--", linewidth=1)
    left.set_ylabel("training time of one epoch (s)")
    right.bar(names, [r["peak_gpu_mem_gib"] for r in ok], color=["tab:blue", "tab:orange"][: len(ok)])
    right.set_ylabel("peak GPU memory (GiB)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"IMDB (b), {', '.join(result['environment']['gpus']) or 'cpu'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="the zerotrain run folder")
    parser.add_argument("--lightning_log", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="path prefix of the .json/.md/.png files")
    parser.add_argument("--steps_per_epoch", type=int, default=781)
    parser.add_argument("--zerotrain_command", required=True)
    parser.add_argument("--lightning_command", required=True)
    args = parser.parse_args()
    result = {"workload": "IMDB preset (b), batch 32", "environment": environment(),
              "commands": [args.zerotrain_command, args.lightning_command],
              "rows": [zerotrain_row(args.run, args.steps_per_epoch), lightning_row(args.lightning_log)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    plot(result, args.out.with_suffix(".png"))
    print(markdown(result), file=sys.stdout)


if __name__ == "__main__":
    main()
