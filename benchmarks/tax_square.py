"""The engine tax from a Latin square: the engines run on several GPUs at once, in rotated orders.

``gpu_suite.sh imdb_tax_square`` runs one fit per GPU in each time slot and waits for all of them before
the next slot; GPU g takes the engines in an order rotated by g, so in each slot the GPUs run different
engines, and each engine runs on every GPU. On one GPU a host-bound step moves more from one process to the
next than two engines differ by (IMDB (b): 6.2 and 8.6 ms for the same engine, BENCHMARKS.md session 22);
many rows, paired two ways, say what the engine itself costs:

* **same GPU, same round**: each row against the plain row that ran on its GPU in its round (cancels
  what differs between GPUs and their CPU slices);
* **at the same time**: each row against the plain row, on another GPU, whose timed steps overlapped its own
  the longest, if for at least half of the shorter of the two (cancels what the whole machine did at that
  moment). Other rows are left unpaired: fits of different engines take different times, so even fits started
  together end their timed steps apart, and sweeps not held in step drift apart (session 23's first square:
  GPUs 2-3 fell a fit behind GPUs 0-1 after a slower first fit). With fewer GPUs than engines the plain engine
  shares its slots with some engines only, and the others get no pair of this kind.

Reads ``gpu<g>/slot<t>/benchmark.json`` (one fit each) or ``gpu<g>/benchmark.json`` (one sweep per GPU). A row's
timed window ends with its fit (the timed steps are the last) and lasts its steps times its s/step; its start
is the row's ``started_unix``, or, in files written before rows had it, the sum of its sweep's earlier rows'
``wall_s`` (every sweep started at the same moment). Writes ``tax_square.json``, ``tax_square.md`` and
``tax_square.png`` (every row's s/step per engine) into the folder it reads.

Given several squares' folders (runs of the part on one kind of machine, each square paired within itself)
and ``--out``, it writes each square's files as above (rewriting them in its folder) and pools their pairs:
``tax_pooled.json``, ``.md`` and ``.png`` (every pair's tax) in ``--out``.

    python benchmarks/tax_square.py OUT/imdb_tax_square [MORE_SQUARES ... --out POOLED_DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

BASELINE = "ddp"


def _number(path: Path, prefix: str) -> int:
    return int(path.name.removeprefix(prefix))


def result_files(folder: Path) -> list[tuple[int, int | None, Path]]:
    """(GPU, slot, file) for every benchmark.json of the square, by GPU and then slot; slot None for a GPU's
    whole sweep. One layout only: a folder holding both is a rerun over old results, which would mix."""
    gpus = sorted((p for p in folder.glob("gpu*") if re.fullmatch(r"gpu\d+", p.name)), key=lambda p: _number(p, "gpu"))
    files: list[tuple[int, int | None, Path]] = []
    for gpu in gpus:
        slots = sorted((p for p in gpu.glob("slot*") if re.fullmatch(r"slot\d+", p.name)), key=lambda p: _number(p, "slot"))
        files += [(_number(gpu, "gpu"), _number(s, "slot"), s / "benchmark.json") for s in slots
                  if (s / "benchmark.json").is_file()]
        if (gpu / "benchmark.json").is_file():
            files.append((_number(gpu, "gpu"), None, gpu / "benchmark.json"))
    if len({slot is None for _, slot, _ in files}) > 1:
        raise SystemExit(f"tax_square: {folder} holds both gpu*/benchmark.json and gpu*/slot*/benchmark.json: "
                         "results of two runs; give it one run's folder")
    return files


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """Every ok row of the square with its GPU, round and timed window (seconds: when its timed steps began
    and ended)."""
    rows: list[dict[str, Any]] = []
    elapsed: dict[int, float] = {}  # per GPU: the wall time of its rows so far
    place: dict[int, int] = {}  # per GPU: the rows so far
    all_rows = [(gpu, slot, row) for gpu, slot, path in result_files(folder)
                for row in json.loads(path.read_text())["rows"]]
    listed = folder / "engines.txt"  # written by the gpu_suite part: the engines of one round, whatever finished
    engines = (len(listed.read_text().split()) if listed.is_file() else len({row["strategy"] for *_, row in all_rows})) or 1
    timestamps = all(row.get("started_unix") is not None for *_, row in all_rows)
    for gpu, slot, row in all_rows:
        start = row["started_unix"] if timestamps else elapsed.get(gpu, 0.0)
        wall = float(row.get("wall_s") or 0.0)
        elapsed[gpu] = elapsed.get(gpu, 0.0) + wall
        n = place[gpu] = place.get(gpu, -1) + 1
        if row.get("status") != "ok" or not row.get("throughput_sec_per_step"):
            continue
        timed = row["throughput_sec_per_step"] * (row.get("throughput_measured_steps") or 0)
        # A slot's round is its number's (a slot whose fit left no file shifts nothing); a sweep's rows carry theirs
        rnd = slot // engines + 1 if slot is not None else row.get("round", n // engines + 1)
        rows.append({"gpu": gpu, "round": rnd, "strategy": row["strategy"],
                     "sec_per_step": row["throughput_sec_per_step"], "timed_from": start + wall - timed,
                     "timed_to": start + wall, "host_cpu_frac": row.get("throughput_host_cpu_frac"),
                     "backward_cpu_frac": row.get("throughput_host_backward_cpu_frac")})
    return rows


def taxes_same_gpu(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per engine, each row's s/step over the plain row's of its GPU and round, minus 1."""
    base = {(r["gpu"], r["round"]): r["sec_per_step"] for r in rows if r["strategy"] == BASELINE}
    taxes: dict[str, list[float]] = {}
    for r in rows:
        ref = base.get((r["gpu"], r["round"]))
        if r["strategy"] != BASELINE and ref:
            taxes.setdefault(r["strategy"], []).append(r["sec_per_step"] / ref - 1)
    return taxes


MIN_OVERLAP = 0.5  # of the shorter timed window: less, and the two rows mostly ran at different moments


def taxes_same_time(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per engine, each row's s/step over that of the plain row on another GPU whose timed window overlapped
    its own the longest, minus 1, where that overlap is at least MIN_OVERLAP of the shorter window; other rows
    are left out. Each row records its best overlap (``overlap``: the share of the shorter window)."""
    plain = [r for r in rows if r["strategy"] == BASELINE]
    taxes: dict[str, list[float]] = {}
    for r in rows:
        if r["strategy"] == BASELINE:
            continue
        best, partner = 0.0, None
        for p in plain:
            shorter = min(r["timed_to"] - r["timed_from"], p["timed_to"] - p["timed_from"])
            both = min(r["timed_to"], p["timed_to"]) - max(r["timed_from"], p["timed_from"])
            if p["gpu"] != r["gpu"] and shorter > 0 and both / shorter > best:
                best, partner = both / shorter, p
        r["overlap"] = round(best, 3)
        if partner is not None and best >= MIN_OVERLAP:
            taxes.setdefault(r["strategy"], []).append(r["sec_per_step"] / partner["sec_per_step"] - 1)
    return taxes


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    same_gpu, same_time = taxes_same_gpu(rows), taxes_same_time(rows)
    engines = []
    for name in dict.fromkeys(r["strategy"] for r in rows):
        times = sorted(r["sec_per_step"] for r in rows if r["strategy"] == name)
        engines.append({
            "strategy": name, "rows": len(times), "median_ms": 1000 * statistics.median(times),
            "fastest_ms": 1000 * times[0], "slowest_ms": 1000 * times[-1],
            "tax_same_gpu": _spread(same_gpu.get(name)), "tax_same_time": _spread(same_time.get(name)),
        })
    gpus = sorted({r["gpu"] for r in rows})
    per_gpu = {g: 1000 * statistics.median(r["sec_per_step"] for r in rows if r["gpu"] == g) for g in gpus}
    return {"baseline": BASELINE, "engines": engines, "median_ms_per_gpu": per_gpu, "rows": rows}


def _spread(values: list[float] | None) -> dict[str, Any] | None:
    if not values:
        return None
    v = sorted(values)
    return {"n": len(v), "median": statistics.median(v), "lowest": v[0], "highest": v[-1],
            "within_5pct": sum(abs(x) <= 0.05 for x in v), "within_10pct": sum(abs(x) <= 0.10 for x in v)}


def _tax_text(t: dict[str, Any] | None, counts: bool = False) -> str:
    """A spread of taxes as "median (lowest to highest, n=pairs)"; ``counts``: with how many lie within 5% and 10%."""
    if t is None:
        return "-"
    within = f"; within 5%: {t['within_5pct']}, within 10%: {t['within_10pct']}" if counts else ""
    return f"{t['median']:+.1%} ({t['lowest']:+.1%} to {t['highest']:+.1%}, n={t['n']}{within})"


def markdown(s: dict[str, Any]) -> str:
    tax = _tax_text
    env = s.get("environment", {})
    t0 = min(r["timed_from"] for r in s["rows"])
    lines = [f"GPUs: {', '.join(env.get('gpus', []))}; torch {env.get('versions', {}).get('torch')}, DeepSpeed "
             f"{env.get('versions', {}).get('deepspeed')}; commit {env.get('commit')}.", "",
             f"Pairs at the same time need timed steps overlapping by {MIN_OVERLAP:.0%} of the shorter window.", "",
             f"First file's command (the others differ in the strategies and --out): `{s['commands'][0]}`", "",
             "| engine | rows | median ms/step | fastest - slowest | tax, same GPU and round | tax, at the same time |",
             "|---|---|---|---|---|---|"]
    for e in s["engines"]:
        lines.append(f"| {e['strategy']} | {e['rows']} | {e['median_ms']:.2f} | {e['fastest_ms']:.2f} - "
                     f"{e['slowest_ms']:.2f} | {tax(e['tax_same_gpu'])} | {tax(e['tax_same_time'])} |")
    lines += ["", "Median ms/step per GPU (all engines): "
              + ", ".join(f"GPU {g} {ms:.2f}" for g, ms in s["median_ms_per_gpu"].items()), "",
              "| GPU | round | engine | ms/step | timed steps, s from the first | best overlap with a plain row "
              "| loop thread on CPU | backward thread on CPU |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(s["rows"], key=lambda r: (r["timed_from"], r["gpu"])):
        shares = [f"{r[k]:.0%}" if r.get(k) is not None else "-" for k in ("overlap", "host_cpu_frac", "backward_cpu_frac")]
        lines.append(f"| {r['gpu']} | {r['round']} | {r['strategy']} | {1000 * r['sec_per_step']:.2f} | "
                     f"{r['timed_from'] - t0:.0f}-{r['timed_to'] - t0:.0f} | {' | '.join(shares)} |")
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files; None where matplotlib is not installed (the plots are skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(s: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [e["strategy"] for e in s["engines"]]
    for i, name in enumerate(names):
        ys = [1000 * r["sec_per_step"] for r in s["rows"] if r["strategy"] == name]
        ax.scatter([i + 0.04 * (k - len(ys) / 2) for k in range(len(ys))], ys, s=14)
        ax.hlines(statistics.median(ys), i - 0.3, i + 0.3, color="k")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per step (every row; line: median)")
    ax.set_title("Engine tax, Latin square over the GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def square(folder: Path) -> dict[str, Any]:
    """One square's summary, its files written into its folder."""
    rows = read_rows(folder)
    if not rows:
        raise SystemExit(f"tax_square: no ok rows in {folder}/gpu*/[slot*/]benchmark.json")
    results = {str(path.relative_to(folder)): json.loads(path.read_text()) for *_, path in result_files(folder)}
    first = next(iter(results.values()))
    s = {**summarize(rows), "environment": first["environment"], "commands": [r["command"] for r in results.values()],
         "files": list(results)}
    (folder / "tax_square.json").write_text(json.dumps(s, indent=1) + "\n")
    (folder / "tax_square.md").write_text(markdown(s))
    plot(s, folder / "tax_square.png")
    return s


def pool(folders: list[Path], squares: list[dict[str, Any]]) -> dict[str, Any]:
    """Every square's pairs together: per engine, the taxes of both kinds of pair from all squares, each pair
    formed within its own square (rows of different squares never ran together)."""
    # engines in the first square's order (the plain one first where it came first), then any new to later ones
    taxes: dict[str, dict[str, list[float]]] = {e["strategy"]: {"same_gpu": [], "same_time": []}
                                                for s in squares for e in s["engines"] if e["strategy"] != BASELINE}
    for s in squares:
        for kind, found in (("same_gpu", taxes_same_gpu(s["rows"])), ("same_time", taxes_same_time(s["rows"]))):
            for engine, values in found.items():
                taxes.setdefault(engine, {"same_gpu": [], "same_time": []})[kind] += values
    return {"baseline": BASELINE, "squares": [str(f) for f in folders],
            "commits": [s["environment"].get("commit") for s in squares],
            "gpus": sorted({g for s in squares for g in s["environment"].get("gpus", [])}),
            "engines": [{"strategy": e, "tax_same_gpu": _spread(t["same_gpu"]), "tax_same_time": _spread(t["same_time"]),
                         "taxes_same_gpu": t["same_gpu"], "taxes_same_time": t["same_time"]} for e, t in taxes.items()]}


def pooled_markdown(p: dict[str, Any]) -> str:
    def tax(t: dict[str, Any] | None) -> str:
        return _tax_text(t, counts=True)

    lines = [f"Pairs of {len(p['squares'])} squares pooled (each pair within its own square); GPUs: "
             f"{', '.join(p['gpus'])}; commits {', '.join(str(c) for c in p['commits'])}.", "",
             "Squares: " + ", ".join(f"`{s}`" for s in p["squares"]), "",
             "| engine | tax, same GPU and round: median (range, pairs) | tax, at the same time: median (range, pairs) |",
             "|---|---|---|"]
    for e in p["engines"]:
        lines.append(f"| {e['strategy']} | {tax(e['tax_same_gpu'])} | {tax(e['tax_same_time'])} |")
    return "\n".join(lines) + "\n"


def pooled_plot(p: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, e in enumerate(p["engines"]):
        for shift, kind, marker in ((-0.12, "taxes_same_gpu", "o"), (0.12, "taxes_same_time", "s")):
            ys = [100 * t for t in e[kind]]
            ax.scatter([i + shift] * len(ys), ys, marker=marker, s=16,
                       label=("same GPU and round" if kind == "taxes_same_gpu" else "at the same time") if i == 0 else None)
            if ys:
                ax.hlines(statistics.median(ys), i + shift - 0.1, i + shift + 0.1, color="k")
    for level in (5, 10):
        ax.axhline(level, color="grey", linestyle=":", linewidth=1)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(p["engines"])), [e["strategy"] for e in p["engines"]])
    ax.set_ylabel(f"tax against {p['baseline']}, % (line: median)")
    ax.set_title(f"Engine tax, pairs of {len(p['squares'])} squares")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="a square's folder: gpu0/slot0/benchmark.json, ...")
    parser.add_argument("--out", type=Path, help="with several folders: where the pooled files go")
    args = parser.parse_args()
    if len(args.folders) > 1 and args.out is None:
        parser.error("--out: several squares are pooled into a folder; name it")
    if len(args.folders) == 1 and args.out is not None:
        parser.error("--out: pools several squares; one square's files go into its own folder")
    if len({f.resolve() for f in args.folders}) < len(args.folders):
        parser.error("a square is named twice: its pairs would count twice")
    squares = [square(folder) for folder in args.folders]
    if len(args.folders) == 1:
        print(markdown(squares[0]))
        return
    pooled = pool(args.folders, squares)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tax_pooled.json").write_text(json.dumps(pooled, indent=1) + "\n")
    (args.out / "tax_pooled.md").write_text(pooled_markdown(pooled))
    pooled_plot(pooled, args.out / "tax_pooled.png")
    print(pooled_markdown(pooled))


if __name__ == "__main__":
    main()
