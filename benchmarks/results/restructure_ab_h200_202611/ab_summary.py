"""Summarise ab_alternating.sh: RUNS/<variant>_<round>/summary.json -> ab_alternating.{json,md,png} in OUT.

    python ab_summary.py RUNS OUT --machine TEXT --commits OLD NEW
"""
import argparse
import json
import statistics
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("runs")
p.add_argument("out")
p.add_argument("--machine", required=True)
p.add_argument("--commits", nargs=2, required=True, metavar=("OLD", "NEW"))
p.add_argument("--versions", default="")
p.add_argument("--command", default="bash ab_alternating.sh (this folder)")
a = p.parse_args()
rows = []
for f in sorted(Path(a.runs).glob("*/summary.json")):
    s = json.loads(f.read_text())
    variant, rnd = f.parent.name.split("_")
    rows.append({"variant": variant, "round": int(rnd), "tokens_per_s": s["throughput_tokens_per_s"],
                 "s_per_step": s["throughput_sec_per_step"], "test_acc": s.get("test_acc")})
by = {(r["variant"], r["round"]): r for r in rows}
rounds = sorted({r["round"] for r in rows if ("old", r["round"]) in by and ("new", r["round"]) in by})
gains = {k: by["new", k]["tokens_per_s"] / by["old", k]["tokens_per_s"] - 1 for k in rounds}
result = {"machine": a.machine, "versions": a.versions, "old_commit": a.commits[0], "new_commit": a.commits[1],
          "command": a.command, "rows": rows,
          "new_against_old_by_round": gains, "median": statistics.median(gains.values()) if gains else None,
          "unpaired": [f"{r['variant']}_{r['round']}" for r in rows if r["round"] not in rounds]}
out = Path(a.out)
(out / "ab_alternating.json").write_text(json.dumps(result, indent=2) + "\n")
lines = ["# IMDB (b), old tree against new, alternating on one H200 of an idle machine", "",
         f"- gpu: {a.machine}", f"- versions: {a.versions}", f"- old_commit: {a.commits[0]}",
         f"- new_commit: {a.commits[1]}", f"- command: {result['command']}",
         "- metric: tokens/s over epoch 1's steps 251-781 and all of epoch 2 (the first 250 steps excluded)", "",
         "| round | variant | tokens/s | s/step | test acc |", "|---|---|---|---|---|"]
lines += [f"| {r['round']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['s_per_step'] * 1e3:.2f} ms | "
          f"{r['test_acc'] if r['test_acc'] is not None else float('nan'):.4f} |"
          for r in sorted(rows, key=lambda r: (r["round"], r["variant"]))]
lines += ["", "new against old by round: " + ", ".join(f"round {k} {g:+.1%}" for k, g in gains.items()),
          f"median: {result['median']:+.1%}" if gains else "median: -",
          "unpaired runs (the other run of the round was stopped by the time limit): "
          + (", ".join(result["unpaired"]) or "none")]
(out / "ab_alternating.md").write_text("\n".join(lines) + "\n")
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.5))
for variant, color in (("old", "tab:grey"), ("new", "tab:blue")):
    pts = [(r["round"], r["tokens_per_s"]) for r in rows if r["variant"] == variant]
    ax.scatter([x for x, _ in pts], [y for _, y in pts], color=color, label=f"{variant} tree", s=40)
ax.set_xlabel("round")
ax.set_ylabel("tokens/s")
ax.set_title("IMDB (b), old tree vs new, alternating on one H200")
ax.legend()
fig.tight_layout()
fig.savefig(out / "ab_alternating.png", dpi=110)
