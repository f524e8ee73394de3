"""Rows of big-model runs on one GPU, read from their run folders' metrics.jsonl (a run stopped by its deadline after
its timed steps has no benchmark.json, but its metrics hold every step): the last timed step's tokens/s, MFU and
seconds a step, and the peaks, against the parameter count.

    python benchmarks/offload_rows.py --out OUT/offload_rows --title TITLE \\
        --run "LABEL=PARAMETERS=RUN_FOLDER" [--run ...]

Writes OUT.json, OUT.md (the table) and OUT.png (tokens/s against parameters, each point labelled with its MFU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(label: str, params: int, folder: Path) -> dict:
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in metrics if "sec_per_step" in m]
    if not timed:
        raise SystemExit(f"{folder / 'metrics.jsonl'}: no timed step (no row with sec_per_step)")
    last = timed[-1]
    hparams = json.loads((folder / "hparams.json").read_text()) if (folder / "hparams.json").is_file() else {}
    env = json.loads((folder / "env.json").read_text()) if (folder / "env.json").is_file() else {}
    return {"label": label, "parameters": params, "folder": str(folder), "timed_steps": len(timed),
            "step": last["step"], "sec_per_step": last["sec_per_step"], "tokens_per_s": last["tokens_per_s"],
            "real_tokens_per_s": last.get("real_tokens_per_s"), "tflops_per_gpu": last.get("tflops_per_gpu"),
            "mfu": last.get("mfu"), "host_rss_peak_gib": max(m.get("host_rss_peak_gib", 0) for m in metrics),
            "gpu_mem_peak_gib": max(m.get("gpu_mem_peak_gib", 0) for m in metrics),
            "command": env.get("command"), "gpus": env.get("gpus"), "versions": env.get("versions"),
            "config": hparams.get("config")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--title", required=True)
    ap.add_argument("--run", action="append", required=True, help="LABEL=PARAMETERS=RUN_FOLDER")
    a = ap.parse_args()
    rows = []
    for spec in a.run:
        parts = spec.split("=", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            raise SystemExit(f"--run {spec!r}: expected LABEL=PARAMETERS=RUN_FOLDER (the label without '=')")
        label, params, folder = parts
        rows.append(row(label, int(params), Path(folder)))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"title": a.title, "rows": rows}, indent=2) + "\n")
    lines = [f"### {a.title}", "", "| row | parameters | s/step | tokens/s (non-padding) | TFLOP/s | MFU | peak GPU GiB "
             "(allocated) | peak host RSS GiB | timed steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['parameters'] / 1e9:.2f}B | {r['sec_per_step']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} ({r['real_tokens_per_s'] or 0:,.0f}) | {r['tflops_per_gpu'] or 0:.1f} | "
                     f"{100 * (r['mfu'] or 0):.1f}% | {r['gpu_mem_peak_gib']:.1f} | {r['host_rss_peak_gib']:.1f} | "
                     f"{r['timed_steps']} |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.scatter(r["parameters"] / 1e9, r["tokens_per_s"], s=40)
        ax.annotate(f"{r['label']}\n{100 * (r['mfu'] or 0):.1f}% MFU", (r["parameters"] / 1e9, r["tokens_per_s"]),
                    textcoords="offset points", xytext=(6, 4), fontsize=7)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens/s")
    ax.set_title(a.title, fontsize=9)
    ax.set_xlim(0, max(r["parameters"] for r in rows) / 1e9 * 1.5)
    ax.set_ylim(0, max(r["tokens_per_s"] for r in rows) * 1.3)
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
