#!/usr/bin/env bash
# IMDB (b), the old tree (.old/src, commit 2455cf7) against the new (src) on two GPUs of one machine at once: each
# round runs both side by side, one on each GPU, and they swap GPUs every round, so a drift of the machine or a
# difference between its GPUs falls on both. Writes ab_pairs.json and ab_pairs.md to $OUT.
set -u
D=.data; TOK=$D/roberta-tokenizer; R=$PWD
IMDB=(imdb --config configs/imdb_b.yaml --data.path $R/$D/imdb --data.tokenizer $R/$TOK --trainer.epochs 2
      --trainer.warmup_steps_excluded 250)
run() {  # run VARIANT NAME GPU
  local v=$1 name=$2 gpu=$3 dir=.
  [ "$v" = old ] && dir=.old
  ( cd "$dir" && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/site:$PWD/src timeout 400 python3 -m zerotrain fit "${IMDB[@]}" \
      --trainer.output_dir "$OUT/runs" --trainer.run_name "$name" --logging.progress_bar false --trainer.export false \
      --checkpoint.save_final false ) > "$OUT/$name.log" 2>&1
}
for r in $(seq 1 "${ROUNDS:-3}"); do
  if [ $((r % 2)) = 1 ]; then a=0 b=1; else a=1 b=0; fi
  run old "old_$r" $a & run new "new_$r" $b & wait
  echo "round $r done (old on GPU $a, new on GPU $b)"
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); rows = []
for f in sorted((out / "runs").glob("*/summary.json")):
    s = json.loads(f.read_text()); variant, rnd = f.parent.name.split("_")
    rows.append({"variant": variant, "round": int(rnd), "tokens_per_s": s.get("throughput_tokens_per_s"),
                 "s_per_step": s.get("throughput_sec_per_step"), "test_acc": s.get("test_acc")})
by = {(r["variant"], r["round"]): r for r in rows}
gains = [by["new", k]["tokens_per_s"] / by["old", k]["tokens_per_s"] - 1 for _, k in by if ("new", k) in by
         and ("old", k) in by and _ == "new"]
result = {"rows": rows, "new_against_old": gains, "median": statistics.median(gains) if gains else None}
(out / "ab_pairs.json").write_text(json.dumps(result, indent=2))
lines = ["| round | variant | tokens/s | s/step | test acc |", "|---|---|---|---|---|"]
lines += [f"| {r['round']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['s_per_step'] * 1e3:.2f} ms | {r['test_acc'] or float('nan'):.4f} |"
          for r in sorted(rows, key=lambda r: (r["round"], r["variant"]))]
lines += ["", "new against old by round: " + ", ".join(f"{g:+.1%}" for g in gains),
          f"median: {result['median']:+.1%}" if gains else "median: -"]
(out / "ab_pairs.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
