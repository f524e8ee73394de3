#!/usr/bin/env bash
# IMDB (b), the old tree (.old/src, commit 2455cf7) against the new (src), alternating on one GPU of an otherwise idle
# machine (the order swaps every round); each run stops at the deadline BUDGET seconds from the start. Writes
# ab_alternating.{json,md,png} to $OUT. Run from a checkout holding the old tree in .old/ and the data in .data/.
set -u
R=$PWD; W=/tmp/ab; mkdir -p $W/runs
END=$((SECONDS + ${BUDGET:-430}))
bounded() { local t=$1; shift; [ "$t" -le 5 ] && return 124; setsid "$@" & local p=$!; ( sleep "$t"; kill -9 -- -$p 2>/dev/null ) & local k=$!; wait $p; local rc=$?; kill $k 2>/dev/null; return $rc; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; free -g | head -2; python3 -c "import torch,deepspeed;print(torch.__version__, torch.version.cuda, deepspeed.__version__)"; } > $W/machine.txt 2>&1
A=(fit imdb --config configs/imdb_b.yaml --data.path $R/.data/imdb --data.tokenizer $R/.data/roberta-tokenizer --trainer.epochs 2
   --trainer.warmup_steps_excluded 250 --trainer.output_dir $W/runs --logging.progress_bar false --trainer.export false
   --checkpoint.save_final false)
run() { local v=$1 r=$2 dir=$R; [ $v = old ] && dir=$R/.old
  local t=$((END - SECONDS)); [ $t -gt 160 ] && t=160
  ( cd $dir && PYTHONPATH=/tmp/site:$dir/src bounded $t python3 -m zerotrain "${A[@]}" --trainer.run_name ${v}_$r ) > $W/${v}_$r.log 2>&1
  echo "${v}_$r rc=$? at $SECONDS s"; }
for r in ${ROUNDS:-1 2 3 4}; do
  if [ $((r % 2)) = 1 ]; then run old $r; run new $r; else run new $r; run old $r; fi
done
python3 "$R/benchmarks/results/restructure_ab_h200_202611/ab_summary.py" $W/runs "$OUT" --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --commits 2455cf7 "$(git -C "$R" rev-parse --short HEAD)"
