"""Put zerotrain's benchmark rows and a peer's rows (benchmarks/hf_trainer.py) into one table and plot.

    python benchmarks/compare_rows.py --out DIR/NAME --title TEXT \
        --zerotrain LABEL=DIR/benchmark.json [...] --peer LABEL=ROW.json [...]

A --zerotrain file may also be a run folder's summary.json (the row of that one ``zerotrain fit`` run).

Writes NAME.json (every row with its label and command, and the machine: GPU, versions, commit), NAME.md (a
table) and NAME.png (non-padding tokens/s by row, MFU written on each bar). Every row comes from the files
given; rows of a failed run keep their status and have no speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any


def _pairs(values: list[str], flag: str) -> list[tuple[str, Path]]:
    out = []
    for value in values:
        label, sep, path = value.partition("=")
        if not sep:
            raise SystemExit(f"{flag}: expected LABEL=PATH, got {value!r}")
        out.append((label, Path(path)))
    return out


def _environment(zerotrain_files: list[Path]) -> dict[str, Any]:
    """The machine and versions the first readable benchmark file recorded, its library versions at the top level."""
    for path in zerotrain_files:
        if path.is_file():
            env = dict(json.loads(path.read_text()).get("environment", {}))
            env.update({k: v for k, v in (env.pop("versions", None) or {}).items() if v is not None})
            return env
    return {}


def collect(zerotrain: list[tuple[str, Path]], peers: list[tuple[str, Path]]) -> list[dict[str, Any]]:
    rows = []
    for label, path in zerotrain:
        if not path.is_file():
            rows.append({"label": label, "source": "zerotrain", "status": f"no result file {path}"})
            continue
        result = json.loads(path.read_text())
        if "rows" not in result:  # a run folder's summary.json: the one run it describes
            rows.append(_summary_row(label, path, result))
            continue
        for row in result["rows"]:
            rows.append({"label": label, "source": "zerotrain", "strategy": row.get("strategy"),
                         "micro_batch_size": row.get("micro_batch_size"), "tokens_per_s": row.get("tokens_per_s"),
                         "mfu": row.get("mfu"), "peak_gpu_mem_gib": row.get("peak_gpu_mem_gib"),
                         "s_per_step": row.get("throughput_sec_per_step"), "n_params": row.get("n_params"),
                         "peak_host_mem_gib": row.get("peak_host_mem_gib"), "steps": row.get("final_step"),
                         "val_loss": row.get("val_loss"),
                         "status": row.get("status"), "command": row.get("command") or result.get("command")})
    for label, path in peers:
        if not path.is_file():
            rows.append({"label": label, "source": "peer", "status": f"no result file {path}"})
            continue
        row = json.loads(path.read_text())
        rows.append({"label": label, "source": "peer", "strategy": row.get("strategy"),
                     "micro_batch_size": None, "tokens_per_s": row.get("tokens_per_s"), "mfu": row.get("throughput_mfu"),
                     "peak_gpu_mem_gib": row.get("gpu_mem_peak_gib"), "s_per_step": row.get("throughput_sec_per_step"),
                     "status": "ok", "command": row.get("command")})
    return rows


def _summary_row(label: str, path: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The row of one ``zerotrain fit`` run from its summary.json, with the command from the run's env.json."""
    env = path.parent / "env.json"
    command = json.loads(env.read_text()).get("command") if env.is_file() else None
    return {"label": label, "source": "zerotrain", "strategy": summary.get("engine"),
            "micro_batch_size": summary.get("micro_batch_size"), "tokens_per_s": summary.get("throughput_real_tokens_per_s"),
            "mfu": summary.get("throughput_mfu"), "peak_gpu_mem_gib": summary.get("gpu_mem_peak_gib"),
            "s_per_step": summary.get("throughput_sec_per_step"), "n_params": summary.get("n_params"),
            "peak_host_mem_gib": summary.get("host_rss_peak_gib"), "steps": summary.get("final_step"),
            "status": "ok" if summary.get("final_step") else "no steps", "command": command}


def markdown(title: str, env: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# {title}", ""]
    for key in ("gpus", "torch", "cuda", "deepspeed", "transformers", "commit", "date"):
        if env.get(key) is not None:
            lines.append(f"- {key}: {env[key]}")
    # Columns only some pages have: shown when a row holds them (a held-out loss, a run's steps, host memory)
    extra = [(head, key, spec) for head, key, spec in (("steps", "steps", "d"), ("held-out loss", "val_loss", ".4f"),
                                                        ("peak host (GiB)", "peak_host_mem_gib", ".1f"))
             if any(r.get(key) is not None for r in rows)]
    lines += ["", "| row | engine | s/step | tokens/s (non-padding) | MFU | peak GPU (GiB) | "
              + "".join(f"{head} | " for head, _, _ in extra) + "status |",
              "|---|---|---|---|---|---|---|" + "---|" * len(extra)]

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        lines.append(f"| {r['label']} | {r.get('strategy') or '-'} | {fmt(r.get('s_per_step'), '.3f')} | "
                     f"{fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu'), '.1%')} | "
                     f"{fmt(r.get('peak_gpu_mem_gib'), '.1f')} | "
                     + "".join(f"{fmt(r.get(key), spec)} | " for _, key, spec in extra) + f"{r.get('status')} |")
    lines += ["", "Commands:", ""] + [f"- {r['label']}: `{r.get('command')}`" for r in rows]
    return "\n".join(lines) + "\n"


def plot(title: str, rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("tokens_per_s")]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(shown) + 1.5))
    colors = ["tab:blue" if r["source"] == "zerotrain" else "tab:gray" for r in shown]
    ax.barh([r["label"] for r in shown], [r["tokens_per_s"] for r in shown], color=colors)
    for i, r in enumerate(shown):
        if r.get("mfu") is not None:
            ax.text(r["tokens_per_s"], i, f" {r['mfu']:.1%} MFU", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(r["tokens_per_s"] for r in shown))  # room for the MFU labels
    ax.set_xlabel("non-padding tokens/s (blue: zerotrain, grey: peer)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="DIR/NAME: writes NAME.json, NAME.md and NAME.png in DIR")
    p.add_argument("--title", required=True)
    p.add_argument("--zerotrain", action="append", default=[], help="LABEL=benchmark.json (zerotrain benchmark)")
    p.add_argument("--peer", action="append", default=[], help="LABEL=row.json (benchmarks/hf_trainer.py)")
    p.add_argument("--commit", help="the commit the rows ran (default: the one the first benchmark file records)")
    args = p.parse_args()
    zerotrain, peers = _pairs(args.zerotrain, "--zerotrain"), _pairs(args.peer, "--peer")
    env = _environment([path for _, path in zerotrain])
    if args.commit:  # the code that ran, where the benchmark recorded another checkout's
        env["commit"] = args.commit
    if not env.get("commit"):
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        env["commit"] = done.stdout.strip() or None
    rows = collect(zerotrain, peers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"title": args.title, "environment": env, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(markdown(args.title, env, rows))
    plot(args.title, rows, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
