"""Compare the loss curves of finished ``zerotrain fit`` runs that differ in one setting: JSON, Markdown and a PNG.

    python benchmarks/loss_curves.py --out OUT/state_precision --title "..." \\
        --run "fp32 states=RUNS/fp32" --run "bf16 states=RUNS/bf16" [--last 50]

Each ``--run`` is LABEL=a run folder (its ``metrics.jsonl``, ``env.json``, ``hparams.json``). A row gives the
mean training loss over the last ``--last`` logged steps, the last validation loss, and both as differences from
the first run's. The plot draws the training losses against the step. The environment (versions, machine, commit)
is the first run's, as its ``env.json`` recorded it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional


def read_run(label: str, folder: Path, last: int) -> dict[str, Any]:
    """The row of one run folder: its curve, the mean of its last ``last`` logged training losses, its last
    validation loss and its command."""
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"--run {label}={folder}: no metrics.jsonl there (a finished zerotrain fit run folder?)")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train:
        raise SystemExit(f"--run {label}={folder}: metrics.jsonl has no training loss")
    tail = [loss for _, loss in train[-last:]]
    env = json.loads((folder / "env.json").read_text()) if (folder / "env.json").is_file() else {}
    return {"label": label, "run": str(folder), "steps": train[-1][0], "train_loss_last_mean": sum(tail) / len(tail),
            "train_losses_averaged": len(tail), "val_loss": val[-1][1] if val else None,
            "val_step": val[-1][0] if val else None, "curve": train, "command": env.get("command"), "env": env}


def _delta(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return None if value is None or base is None else value - base


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v)
    lines = [f"### {result['title']}", "",
             f"Machine: {', '.join(env.get('gpus') or []) or 'CPU'} ({env.get('cpu_count')} cores). Versions: {versions}. "
             f"Commit: {env.get('commit')}. Command: `{result['command']}`", "",
             f"| run | steps | mean training loss, last {result['last']} logged steps | difference | validation loss "
             "| difference |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        def cell(x: Optional[float], sign: bool = False) -> str:
            return "-" if x is None else (f"{x:+.4f}" if sign else f"{x:.4f}")
        lines.append(f"| {row['label']} | {row['steps']} | {cell(row['train_loss_last_mean'])} | "
                     f"{cell(row['train_delta'], True)} | {cell(row['val_loss'])} | {cell(row['val_delta'], True)} |")
    lines += ["", "Commands:", ""] + [f"- {row['label']}: `{row['command']}`" for row in result["rows"]]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in result["rows"]:
        steps, losses = zip(*row["curve"])
        ax.plot(steps, losses, label=row["label"], linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(result["title"], fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path prefix: OUT.json, OUT.md and OUT.png are written")
    p.add_argument("--title", required=True)
    p.add_argument("--run", action="append", required=True, help="LABEL=run folder (the first is the reference)")
    p.add_argument("--last", type=int, default=50, help="logged training losses averaged at the end of each run")
    args = p.parse_args()
    if args.last < 1:
        p.error(f"--last must be >= 1, got {args.last}")
    rows = []
    for value in args.run:
        label, sep, folder = value.partition("=")
        if not sep:
            p.error(f"--run: expected LABEL=FOLDER, got {value!r}")
        rows.append(read_run(label, Path(folder), args.last))
    base = rows[0]
    for row in rows:
        row["train_delta"] = _delta(row["train_loss_last_mean"], base["train_loss_last_mean"])
        row["val_delta"] = _delta(row["val_loss"], base["val_loss"])
    environment = rows[0].pop("env")
    for row in rows[1:]:
        row.pop("env")
    result = {"title": args.title, "last": args.last, "command": " ".join(["python", *sys.argv]),
              "environment": environment, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(result))
    plot(result, Path(args.out + ".png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
