#!/usr/bin/env bash
# Old commit (.old/src, old flags) against new (src) on one GPU, alternating: IMDB (b) and BERT-base MLM (ZeRO-0, bf16).
set -u
D=.data; TOK=$D/roberta-tokenizer
run() {  # run VARIANT NAME ARGS...
  local v=$1 name=$2; shift 2
  local src=src; [ "$v" = old ] && src=.old/src
  ( cd "$([ "$v" = old ] && echo .old || echo .)" && PYTHONPATH=/tmp/site:$PWD/src timeout 400 python3 -m zerotrain fit "$@" \
      --trainer.output_dir "$OUT/runs" --trainer.run_name "$name" --logging.progress_bar false --trainer.export false \
      --checkpoint.save_final false ) > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(python3 -c "import json,sys;s=json.load(open('$OUT/runs/$name/summary.json'));print({k:s.get(k) for k in ('s_per_step','tokens_per_s','mfu','test_acc')})" 2>&1 | tail -1)"
}
R=$PWD
IMDB_OLD=(imdb --config configs/imdb_b.yaml --data.path $R/$D/imdb --data.tokenizer $R/$TOK --trainer.epochs 2 --trainer.warmup_steps_excluded 250)
IMDB_NEW=("${IMDB_OLD[@]}")
BERT=(mlm --data.train_path $R/$D/gutenberg/train.txt.xz --data.val_path $R/$D/gutenberg/validation.txt.xz --data.tokenizer $R/$TOK
  --data.max_train_lines 60000 --data.max_val_lines 2000 --model.num_layers 12 --model.num_heads 12 --model.h_dim 768
  --model.ff_dim 3072 --model.max_seq_length 512 --trainer.micro_batch_size 128 --trainer.max_steps 60 --trainer.log_every_steps 10
  --trainer.warmup_steps_excluded 20 --trainer.eval_max_batches 2 --trainer.eval_every_steps 100000 --scheduler.name warmup_linear
  --scheduler.warmup_steps 20 --optimizer.lr 1e-4 --trainer.evaluate false)
BERT_OLD=("${BERT[@]}" --strategy.precision bf16 --strategy.compile true --strategy.compile_scope stack --strategy.compile_mode reduce-overhead)
BERT_NEW=("${BERT[@]}" --precision.dtype bf16 --compile.enabled true --compile.scope stack --compile.mode reduce-overhead)
case ${1:-all} in
  imdb) for r in ${ROUNDS:-1 2}; do run old imdb_old_$r "${IMDB_OLD[@]}"; run new imdb_new_$r "${IMDB_NEW[@]}"; done ;;
  bert) for r in 1 2; do run new bert_new_$r "${BERT_NEW[@]}"; run old bert_old_$r "${BERT_OLD[@]}"; done ;;
esac
