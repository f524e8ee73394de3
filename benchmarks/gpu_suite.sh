#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md. Run from the repository root on a GPU machine with the
# data in .data/ (imdb/, roberta-tokenizer/, gutenberg/). Results go to ${OUT:-benchmarks/results}/<part>/.
#   bash benchmarks/gpu_suite.sh tests|fastpath|mlm|imdb_b|imdb_sweep|lora|lora_hf|plan_imdb_b|plan_bert|plan_hello|plan_bert_2gpu|imdb_tax|profile_bert|profile_lora|probe_mlm|lora_vs_hf|plan_imdb_lora|plan_lora|plan_offload|imdb_compile|scaling|bert_compile|offload_5b|profile_lora2|imdb_pad|lora_compiled|imdb_lightning|probe_5b|export_5b|offload_12b|offload_host125|imdb_compiled_full|bert_mfu|imdb_scope|bert_decoder|host|bert_graphs|bert_head|bert_sync|sync_sites|scaling_sync|bert_loss|bert_ln|bert_mb|imdb_tax_ab|host_calls|scaling_rs|scaling_rounds|scaling_gc|imdb_tax_square|pyspy_imdb|tests_parallel|engine_host
#   (lora_hf: the Trainer row alone)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
D=${DATA:-.data}
TOK=$D/roberta-tokenizer
z() { python3 -m zerotrain "$@"; }
# MLM at BERT-base shape (12 layers, 768 wide, 12 heads, FFN 3072, seq 512), micro-batch 32, bf16, Gutenberg text
BERT=(--data.train_path "$D/gutenberg/train.txt.xz" --data.val_path "$D/gutenberg/validation.txt.xz"
      --data.tokenizer "$TOK" --data.max_train_lines 60000 --data.max_val_lines 2000
      --model.num_layers 12 --model.num_heads 12 --model.h_dim 768 --model.ff_dim 3072 --model.max_seq_length 512
      --trainer.micro_batch_size 32 --trainer.max_steps ${STEPS:-120} --trainer.log_every_steps 10
      --trainer.warmup_steps_excluded 20 --trainer.eval_max_batches 4 --trainer.eval_every_steps 100000
      --precision.dtype bf16 --scheduler.name warmup_linear --scheduler.warmup_steps 20 --optimizer.lr 1e-4
      --checkpoint.save_final false)

# MLM 24 layers x 4096 (FFN 16384, 32 heads; 5.06B parameters), activation checkpointing, 6 steps, no evaluation or export
BIG=("${BERT[@]}" --model.num_layers 24 --model.h_dim 4096 --model.ff_dim 16384 --model.num_heads 32
     --activation_checkpointing.enabled true --trainer.max_steps 6 --trainer.warmup_steps_excluded 2
     --trainer.log_every_steps 1 --scheduler.warmup_steps 1 --trainer.evaluate false --trainer.export false)

# LoRA 1.2B: the Llama-style model from configs/llama_1b_config.json (random init), LoRA r=8 on q/v, 2,000 IMDB
# prompts of up to 512 tokens (benchmarks/make_sft_data.py writes them to /tmp/sft.jsonl), micro-batch 4, bf16
LORA=(--model.init random --model.config configs/llama_1b_config.json --model.tokenizer "$TOK"
      --data.train_path /tmp/sft.jsonl --data.max_length 512 --trainer.micro_batch_size 4
      --precision.dtype bf16 --optimizer.lr 2e-4 --trainer.num_workers 2 --checkpoint.save_final false)
# The A/B parts swap $PWD/src for OLD_SRC in PYTHONPATH; without both, the "old" rows would run this code
old_src_on_path() {
  if [ -z "${OLD_SRC:-}" ] || [[ ":${PYTHONPATH:-}:" != *":$PWD/src:"* ]]; then
    echo "$part: needs OLD_SRC=<old checkout>/src and \$PWD/src on PYTHONPATH; skipped" >&2; return 1
  fi
}
# Runs a command with OLD_SRC's code in place of this checkout's, recorded under OLD_COMMIT (after old_src_on_path)
old() { PYTHONPATH="${PYTHONPATH/$PWD\/src/$OLD_SRC}" ZEROTRAIN_COMMIT="${OLD_COMMIT:-old}" "$@"; }
# IMDB preset (b) for 2 epochs per engine (EPOCHS), all but the first timed (every padded length seen once):
# imdb_tax OUTDIR STRATEGIES [TIME LIMIT IN S]; PREDICT=false: no memory prediction (its probe) per row;
# ROUNDS=N: every engine N times, alternating order, with the median tax of the rounds (zerotrain benchmark --rounds)
imdb_tax() {
  timeout "${3:-0}" python3 -m zerotrain benchmark imdb --strategies "$2" --nproc 1 --out "$1" --config configs/imdb_b.yaml \
    --data.pad_to_multiple_of ${PAD:-64} --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs ${EPOCHS:-2} \
    --trainer.warmup_steps_excluded 781 --trainer.evaluate false --trainer.export false \
    --checkpoint.save_final false --predict ${PREDICT:-true} --rounds ${ROUNDS:-1} --profile ${PROFILE:-0} \
    | tail -n $((6 + 4 * ${ROUNDS:-1}))
}
sft() { python3 benchmarks/make_sft_data.py "$D/imdb/train.jsonl.gz" /tmp/sft.jsonl --n 2000; }

# zerotrain plan with --compare_strategies: the planner's own pick (its top 3 predicted, trialled) against every
# strategy at the configured micro-batch, all measured in one session; plan.json -> plan_<workload>.json
plan() {
  local name=$1; shift
  mkdir -p "$OUT/plan"
  z plan "$@" --out "$OUT/plan/$name" --compare_strategies --trials 3 > "$OUT/plan/$name.log" 2>&1
  echo "plan $name rc=$?"; tail -n 4 "$OUT/plan/$name.log"
  [ -f "$OUT/plan/$name/plan.json" ] && cp "$OUT/plan/$name/plan.json" "$OUT/plan/plan_$name.json"
}

for part in "$@"; do
  [ "$part" = lora_hf ] || mkdir -p "$OUT/$part"  # lora_hf writes into $OUT/lora
  case $part in
    plan_imdb_b)  # offloads left out (a 17.9M-parameter model fits many times over); epochs start at their longest batch
      plan imdb_b imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trial_steps 20 \
        --strategies ddp,zero0,zero1,zero2,zero3 ;;
    plan_bert)  # offload left out: ~3x slower at this size on one GPU (earlier sweeps), and the call has 10 minutes
      plan bert_base_1gpu mlm "${BERT[@]}" --trial_steps 10 --strategies ddp,zero0,zero1,zero2,zero3 ;;
    plan_hello)  # MLM at HelloDeepSpeed's dims (6 layers, 8 heads, h 256, ff 512, seq 512), micro-batch 8, bf16
      plan hello_mlm mlm "${BERT[@]}" --model.num_layers 6 --model.num_heads 8 --model.h_dim 256 --model.ff_dim 512 \
        --trainer.micro_batch_size 8 --trial_steps 20 --strategies ddp,zero0,zero1,zero2,zero3 ;;
    plan_bert_2gpu)  # offload left out: BERT-base fits each GPU many times over
      plan bert_base_2gpu mlm "${BERT[@]}" --trial_steps 10 --launch.nproc_per_node 2 \
        --strategies ddp,zero1,zero2 ;;
    plan_imdb_lora)  # IMDB (b) again with the 16-bit probe and longer trials; LoRA 1.2B (random weights, the
      # tutorial's model shape) among the strategies that make sense for a 1.2B frozen base on one GPU
      plan imdb_b_v2 imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" \
        --strategies ddp,zero0,zero1,zero2
      sft; plan lora_1b lora "${LORA[@]}" --strategies ddp,zero0,zero2,zero2_offload --trials 2 --trial_steps 5 ;;
    plan_lora)  # LoRA 1.2B alone (random weights, the tutorial's model shape), the strategies that make sense for
      # a frozen 1.2B base on one GPU
      sft; plan lora_1b lora "${LORA[@]}" --strategies ddp,zero0,zero2_offload --trials 2 --trial_steps 5 ;;
    plan_offload)  # a model too large for plain training on the GPU it gets: MLM 0.93B (16 layers x 2048, FFN 8192),
      # micro-batch 8, on a GPU capped at 12 GiB (--trainer.gpu_memory_gib, as a 12 GB card): fp32 weights with
      # Adam need ~15 GB, so only the offloads fit
      plan mlm_0b9_12gib mlm "${BERT[@]}" --model.num_layers 16 --model.num_heads 16 --model.h_dim 2048 \
        --model.ff_dim 8192 --trainer.micro_batch_size 8 --trainer.gpu_memory_gib 12 --trial_steps 3 \
        --strategies ddp,zero2,zero1_offload,zero2_offload,zero3_offload ;;
    probe_mlm)  # the probe alone at BERT-base (micro 32) and HelloDeepSpeed's dims (micro 8): a plan's
      # predictions recomputed from it (benchmarks/repredict.py) against trials measured earlier on the same GPU kind
      python3 -m zerotrain.probe mlm --out "$OUT/probe_mlm/bert_base.json" --max_micro 32 "${BERT[@]}"; echo "probe bert rc=$?"
      python3 -m zerotrain.probe mlm --out "$OUT/probe_mlm/hello.json" --max_micro 8 "${BERT[@]}" --model.num_layers 6 \
        --model.num_heads 8 --model.h_dim 256 --model.ff_dim 512 --trainer.micro_batch_size 8; echo "probe hello rc=$?" ;;
    imdb_tax)  # preset (b), 2 epochs per engine, only the second timed (every padded length has been seen once):
      # the plain engine against ZeRO-0/1/2 (the fast-path issue's target 1 at IMDB), predicted memory per row.
      # PAD=8: batches padded as before session 8 (128 lengths, not 16); STRATS: fewer engines, to fit a call;
      # PROFILE=N: a profile of N steps at the start of the timed epoch, per row
      imdb_tax "$OUT/imdb_tax" ${STRATS:-ddp,zero0,zero1,zero2} ;;
    host_calls)  # IMDB preset (b) as shipped, 2 epochs per engine (HOST_STRATS), cProfile and the garbage collector
      # watched over steps 900-1400 of the second epoch (every padded length recorded by then): benchmarks/host_calls.py
      for s in ${HOST_STRATS:-ddp zero0 zero1}; do
        st=(--strategy.zero_stage ${s#zero}); [ $s = ddp ] && st=(--strategy.backend ddp)
        timeout ${HOST_S:-170} python3 benchmarks/host_calls.py --first 900 --last 1400 "$OUT/host_calls/$s" fit imdb \
          --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs 2 \
          --trainer.evaluate false --trainer.export false --checkpoint.save_final false --logging.progress_bar false \
          --trainer.output_dir /tmp/host_calls_runs "${st[@]}" > "$OUT/host_calls/$s.log" 2>&1
        echo "$s rc=$?"; head -n 1 "$OUT/host_calls/$s/host_calls.md" 2>/dev/null || tail -n 3 "$OUT/host_calls/$s.log"
      done ;;
    imdb_tax_square)  # target 1 at IMDB (b) on every GPU at once, as a Latin square: in each time slot every GPU runs one
      # fit, and the next slot starts when all have ended; GPU g takes the engines in an order rotated by g (so a slot's
      # GPUs run different engines, and each engine runs on every GPU), ROUNDS times (every other round reversed), each
      # GPU's fits on their own slice of the CPUs. benchmarks/tax_square.py pairs each row with a plain row, on its GPU
      # and in its round, and at the same time (with fewer GPUs than engines, the plain engine meets only some of the
      # others in a slot). Uses as many GPUs as there are engines at most. EPOCHS (default 3): all but the first
      # timed, ~10 s, so that fits of engines that start or end a few seconds apart still share most of it; CPUS=all: no slices;
      # LIMIT_S: each fit's time limit. benchmarks/tax_square.py A B ... --out DIR pools several squares' pairs
      S=${STRATS:-ddp,zero0,zero1,zero2}; E=(${S//,/ }); k=${#E[@]}
      n=$(nvidia-smi -L | wc -l); [ "$n" -gt "$k" ] && n=$k
      rm -rf "$OUT/imdb_tax_square"; mkdir -p "$OUT/imdb_tax_square"  # a rerun's old slots would mix in
      echo "${E[*]}" > "$OUT/imdb_tax_square/engines.txt"  # the slots' rounds, for tax_square.py
      cpus=($(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)))")); per=$(( ${#cpus[@]} / n ))
      # WARMUP=0 leaves it out: first, one untimed epoch of every engine, engine i on GPU i mod n, so that the
      # compiler's and DeepSpeed's caches hold every engine's before slot 0 (session 25: on a fresh machine slot 0's
      # fits had done 50-250 of 2,343 steps at a 150 s LIMIT_S; on the first square of another, ZeRO-1/2's had logged
      # none). WARMUP_LIMIT_S (default 600) bounds each; its files (warmup/) stay out of the square
      if [ "${WARMUP:-1}" != 0 ]; then
        mkdir -p "$OUT/imdb_tax_square/warmup"
        for i in "${!E[@]}"; do
          ( CUDA_VISIBLE_DEVICES=$(( i % n )) PREDICT=false ROUNDS=1 EPOCHS=1 imdb_tax "$OUT/imdb_tax_square/warmup/${E[i]}" \
              "${E[i]}" ${WARMUP_LIMIT_S:-600} > "$OUT/imdb_tax_square/warmup/${E[i]}.log" 2>&1
            echo "warm-up ${E[i]} on GPU $(( i % n )): rc=$?" ) &
        done
        wait
      fi
      for t in $(seq 0 $(( ${ROUNDS:-2} * k - 1 ))); do
        for g in $(seq 0 $((n - 1))); do
          r=$(( g * k / n )); rot=("${E[@]:r}" "${E[@]:0:r}")
          i=$(( t % k )); [ $(( t / k % 2 )) -eq 1 ] && i=$(( k - 1 - i ))  # every other round reversed
          mkdir -p "$OUT/imdb_tax_square/gpu$g"
          ( if [ "${CPUS:-}" != all ] && [ "$per" -ge 1 ]; then
              slice=$(IFS=,; echo "${cpus[*]:$(( g * per )):per}")
              taskset -cp "$slice" $BASHPID || exit 1
            fi
            CUDA_VISIBLE_DEVICES=$g PREDICT=false ROUNDS=1 EPOCHS=${EPOCHS:-3} imdb_tax "$OUT/imdb_tax_square/gpu$g/slot$t" \
              "${rot[i]}" ${LIMIT_S:-0}
          ) >> "$OUT/imdb_tax_square/gpu$g.log" 2>&1 &
        done
        wait  # the slot ends with its slowest fit
      done
      python3 benchmarks/tax_square.py "$OUT/imdb_tax_square" | sed -n '/^| engine/,/^$/p' ;;
    engine_host)  # each engine's host time of one IMDB (b) step (preset as shipped: compiled stack, CUDA graphs), all
      # built in one process and timed in alternating blocks: benchmarks/engine_host.py (micro-batch 32 x 320 tokens)
      python3 benchmarks/engine_host.py "$OUT/engine_host" --steps ${STEPS:-50} --blocks ${BLOCKS:-10} \
        -- --data.tokenizer "$TOK" > "$OUT/engine_host/engine_host.log" 2>&1
      echo "engine_host rc=$?"; tail -n 8 "$OUT/engine_host/engine_host.log" ;;
    tests_parallel)  # pytest -m gpu spread over the GPUs in GPUS (default: all): the one-GPU tests dealt out
      # round-robin, one pytest per GPU, then the two-GPU ones (named two_ranks) on the first two; a log per pytest
      IFS=, read -ra G <<< "${GPUS:-$(seq -s, 0 $(( $(nvidia-smi -L | wc -l) - 1 )))}"
      python3 -m pytest -m gpu --collect-only -q tests | grep '::' > "$OUT/$part/ids.txt"
      for k in "${!G[@]}"; do
        grep -v two_ranks "$OUT/$part/ids.txt" | awk -v n=${#G[@]} -v k=$k 'NR % n == k' > "$OUT/$part/ids_gpu${G[k]}.txt"
        [ -s "$OUT/$part/ids_gpu${G[k]}.txt" ] || continue
        CUDA_VISIBLE_DEVICES=${G[k]} xargs -r -a "$OUT/$part/ids_gpu${G[k]}.txt" -d '\n' python3 -m pytest -q -m gpu \
          > "$OUT/$part/pytest_gpu${G[k]}.txt" 2>&1 &
      done
      wait
      # xargs -r: no ids, no pytest (one without ids would run the whole suite)
      [ ${#G[@]} -ge 2 ] && grep two_ranks "$OUT/$part/ids.txt" | CUDA_VISIBLE_DEVICES=${G[0]},${G[1]} \
        xargs -r -d '\n' python3 -m pytest -q -m gpu > "$OUT/$part/pytest_two_gpus.txt" 2>&1
      tail -n 1 "$OUT/$part"/pytest_*.txt ;;
    pyspy_imdb)  # where IMDB (b)'s loop thread is, on a CPU or not, while it trains: py-spy (carried in .whl) attached
      # after step 850 of a 4-epoch run, one engine of STRATS per GPU at once; three 3 s recordings per engine, raw
      # stacks, the most telling first (session 23's limit cut all but the first): every thread's samples, running or
      # not (--idle), the same with native frames (100 Hz: the process is paused for each), only GIL holders (--gil).
      # Read them with benchmarks/stack_shares.py
      i=0
      S=${STRATS:-ddp,zero0}
      rm -rf "$OUT/pyspy_imdb"; mkdir -p "$OUT/pyspy_imdb"  # a rerun's fit would refuse the old run's folder
      for s in ${S//,/ }; do
        CUDA_VISIBLE_DEVICES=$i z benchmark imdb --strategies $s --nproc 1 --predict false --out "$OUT/pyspy_imdb/$s" \
          --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs 4 \
          --trainer.warmup_steps_excluded 781 --trainer.evaluate false --trainer.export false \
          --checkpoint.save_final false > "$OUT/pyspy_imdb/$s.log" 2>&1 &
        ( m="$OUT/pyspy_imdb/$s/runs/imdb-$s-1gpu/metrics.jsonl"
          for _ in $(seq 300); do grep -q '"step": 850,' "$m" 2>/dev/null && break; sleep 1; done
          pid=  # the training process: zerotrain's loop on its stack, and not a loader worker forked from it
          for p in $(pgrep -f "run_name imdb-$s-1gpu"); do
            d=$(py-spy dump -p "$p" 2>/dev/null); [[ $d == *loop.py* && $d != *_worker_loop* ]] && pid=$p
          done
          echo "$s: training process ${pid:-not found}" >&2
          [ -n "$pid" ] || exit 0
          for rec in "idle --idle --nonblocking -r 500" "native --idle --native -r 100" "gil --gil --nonblocking -r 500"; do
            set -- $rec; name=$1; shift
            py-spy record -p "$pid" --threads -d 3 -f raw -o "$OUT/pyspy_imdb/${s}_$name.txt" "$@" \
              > "$OUT/pyspy_imdb/${s}_$name.log" 2>&1
          done ) &
        i=$((i + 1))
      done
      wait
      tail -n 2 "$OUT"/pyspy_imdb/*.log ;;
    imdb_tax_ab)  # imdb_tax with this code, then ZeRO-1/2 (AB_STRATS) with OLD_SRC's: zerotrain.zero_host's one-rank
      # reduction skip and one-launch norm against DeepSpeed's per-tensor path
      old_src_on_path || continue
      imdb_tax "$OUT/imdb_tax_ab/new" ${STRATS:-ddp,zero0,zero1,zero2} ${NEW_S:-360}
      old imdb_tax "$OUT/imdb_tax_ab/old" ${AB_STRATS:-zero1} ${OLD_S:-200} ;;
    profile_bert)  # where BERT-base's step time goes now: the plain engine and ZeRO-0, 5 profiled steps each,
      # eager and under torch.compile
      z benchmark mlm --strategies ddp,zero0 --profile 5 --predict false --out "$OUT/profile_bert/eager" "${BERT[@]}" | tail -n 4
      z benchmark mlm --strategies ddp,zero0 --profile 5 --predict false --out "$OUT/profile_bert/compiled" "${BERT[@]}" \
        --compile.enabled true | tail -n 4 ;;
    profile_lora)  # LoRA 1.2B at micro-batch 4, ZeRO-0 (the plan's pick): where a ~190 ms step goes
      sft; z benchmark lora --strategies zero0 --profile 5 --predict false --out "$OUT/profile_lora" "${LORA[@]}" \
        --trainer.max_steps 30 --trainer.log_every_steps 5 --trainer.warmup_steps_excluded 5 \
        --scheduler.warmup_steps 5 | tail -n 3 ;;
    profile_lora2)  # target 6's configuration (the tutorial's ZeRO-2 + CPU-offload JSON), eager and compiled: the
      # host time of forward, backward and optimizer step, and kernel launches a step
      sft; for c in false true; do
        z benchmark lora --strategies zero2 --profile 5 --predict false --out "$OUT/profile_lora2/compile_$c" "${LORA[@]}" \
          --trainer.max_steps 40 --trainer.log_every_steps 5 --trainer.warmup_steps_excluded 25 --scheduler.warmup_steps 5 \
          --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json --compile.enabled $c | tail -n 2
      done ;;
    lora_compiled)  # lora_vs_hf's zerotrain row alone, with dynamo's recompilations logged (TORCH_LOGS=recompiles)
      sft; FLAGS=("${LORA[@]}" --trainer.max_steps 120 --trainer.log_every_steps 10 --trainer.warmup_steps_excluded 40
                 --scheduler.warmup_steps 5 --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json)
      TORCH_LOGS=recompiles z fit lora "${FLAGS[@]}" --strategy.zero_stage 2 --compile.enabled true \
        --data.bucket_by_length true --data.pad_to_multiple_of 64 --trainer.output_dir "$OUT/lora_compiled/runs" \
        --trainer.run_name compiled --logging.progress_bar false > "$OUT/lora_compiled/log.txt" 2>&1
      echo "lora_compiled rc=$?"; grep -c "Recompiling" "$OUT/lora_compiled/log.txt"
      cp "$OUT/lora_compiled/runs/compiled/summary.json" "$OUT/lora_compiled/summary.json"
      cp "$OUT/lora_compiled/runs/compiled/metrics.jsonl" "$OUT/lora_compiled/metrics.jsonl" ;;
    lora_vs_hf)  # the fast-path issue's target 6: LoRA 1.2B, the tutorial's ZeRO-2 + CPU-offload JSON for every row,
      # 120 steps with the first 40 untimed (compilation is in them): zerotrain with torch.compile (the 22 decoder
      # layers compiled one by one) and length-grouped batches, zerotrain eager, and the Hugging Face Trainer;
      # non-padding tokens/s in all three (LORA_EAGER=0 leaves the eager row out)
      sft; FLAGS=("${LORA[@]}" --trainer.max_steps 120 --trainer.log_every_steps 10 --trainer.warmup_steps_excluded 40
                 --scheduler.warmup_steps 5 --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json)
      z benchmark lora --strategies zero2 --predict false --out "$OUT/lora_vs_hf/compiled" "${FLAGS[@]}" \
        --compile.enabled true --data.bucket_by_length true --data.pad_to_multiple_of 64 | tail -n 3
      [ "${LORA_EAGER:-1}" = 1 ] && z benchmark lora --strategies zero2 --predict false --out "$OUT/lora_vs_hf/eager" "${FLAGS[@]}" | tail -n 3
      python3 benchmarks/hf_trainer_lora.py --out "$OUT/lora_vs_hf/hf_trainer.json" --warmup 40 -- "${FLAGS[@]}" \
        > "$OUT/lora_vs_hf/hf_trainer.log" 2>&1; echo "hf_trainer rc=$?"; tail -n 8 "$OUT/lora_vs_hf/hf_trainer.log" ;;
    imdb_pad)  # target 3: preset (b) as shipped (batches padded to a multiple of 64), the full 5 epochs with its test
      # score; then 2 epochs padded to a multiple of 8 (the preset before), training only, on the same GPU
      z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.export false \
        --checkpoint.save_final false --trainer.output_dir "$OUT/imdb_pad/runs" --trainer.run_name pad64 \
        --logging.progress_bar false > "$OUT/imdb_pad/pad64.log" 2>&1; echo "imdb pad64 rc=$?"; grep -h "test:" "$OUT/imdb_pad/pad64.log"
      z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs 2 \
        --trainer.evaluate false --trainer.export false --checkpoint.save_final false --data.pad_to_multiple_of 8 \
        --trainer.output_dir "$OUT/imdb_pad/runs" --trainer.run_name pad8 --logging.progress_bar false \
        > "$OUT/imdb_pad/pad8.log" 2>&1; echo "imdb pad8 rc=$?"
      for r in pad64 pad8; do cp "$OUT/imdb_pad/runs/$r/summary.json" "$OUT/imdb_pad/${r}_summary.json"
        cp "$OUT/imdb_pad/runs/$r/metrics.jsonl" "$OUT/imdb_pad/${r}_metrics.jsonl"; done ;;
    imdb_compile)  # preset (b), 2 epochs, training only: eager (as shipped) against --compile.enabled true
      for c in false true; do
        z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs 2 \
          --trainer.evaluate false --trainer.export false --checkpoint.save_final false --compile.enabled $c \
          --trainer.output_dir "$OUT/imdb_compile/runs" --trainer.run_name "compile_$c" --logging.progress_bar false \
          > "$OUT/imdb_compile/compile_$c.log" 2>&1
        echo "imdb compile=$c rc=$?"; cp "$OUT/imdb_compile/runs/compile_$c/summary.json" "$OUT/imdb_compile/compile_${c}_summary.json"
        cp "$OUT/imdb_compile/runs/compile_$c/metrics.jsonl" "$OUT/imdb_compile/compile_${c}_metrics.jsonl"
      done ;;
    imdb_compiled_full)  # target 3: preset (b) with --compile.enabled true (--compile.scope SCOPE, blocks by default), the
      # full 5 epochs with its test score
      z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.export false \
        --checkpoint.save_final false --compile.enabled true --compile.scope "${SCOPE:-blocks}" \
        --trainer.output_dir "$OUT/imdb_compiled_full/runs" \
        --trainer.run_name compiled --logging.progress_bar false > "$OUT/imdb_compiled_full/compiled.log" 2>&1
      echo "imdb compiled rc=$?"; grep -h "test:\|torch.compile" "$OUT/imdb_compiled_full/compiled.log"
      cp "$OUT/imdb_compiled_full/runs/compiled/summary.json" "$OUT/imdb_compiled_full/compiled_summary.json"
      cp "$OUT/imdb_compiled_full/runs/compiled/metrics.jsonl" "$OUT/imdb_compiled_full/compiled_metrics.jsonl" ;;
    imdb_lightning)  # target 3 side by side: preset (b) as shipped, the full 5 epochs with its test score, then the
      # tutorial's Lightning script (PEER=path) for one epoch on the same GPU; both rows in imdb_vs_lightning.json
      ZCMD=(python3 -m zerotrain fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK"
            --trainer.export false --checkpoint.save_final false --trainer.output_dir "$OUT/imdb_lightning/runs"
            --trainer.run_name preset_b --logging.progress_bar false)
      LCMD=(python3 "${PEER:-$D/peers/tutorial_imdb_lightning.py}" "$D/imdb" "$TOK" auto 1 0 1)
      "${ZCMD[@]}" > "$OUT/imdb_lightning/zerotrain.log" 2>&1; echo "zerotrain rc=$?"
      "${LCMD[@]}" > "$OUT/imdb_lightning/lightning.log" 2>&1; echo "lightning rc=$?"
      python3 benchmarks/imdb_vs_lightning.py --run "$OUT/imdb_lightning/runs/preset_b" \
        --lightning_log "$OUT/imdb_lightning/lightning.log" --out "$OUT/imdb_lightning/imdb_vs_lightning" \
        --zerotrain_command "${ZCMD[*]}" --lightning_command "${LCMD[*]}" ;;
    scaling)  # BERT-base, micro-batch 32 per GPU: every one-GPU engine (the engine-tax target too), then ZeRO-1/2
      # and DDP on two GPUs, and on four where the machine has them. S1/S2/S4 narrow the strategies (S4 defaults to S2); EXTRA adds flags to
      # every row (session 12: EXTRA="--compile.enabled true --compile.scope stack"); S1=none skips the
      # one-GPU rows; TAG names the result folder (scaling$TAG) so variants of one call sit side by side
      dir="$OUT/scaling${TAG:-}"
      if [ "${S1:-}" != none ]; then
        z benchmark mlm --strategies ${S1:-ddp,zero0,zero1,zero2} --nproc 1 --out "$dir/1gpu" "${BERT[@]}" ${EXTRA:-} | tail -n 6
      fi
      z benchmark mlm --strategies ${S2:-ddp,zero1,zero2} --nproc 2 --out "$dir/2gpu" "${BERT[@]}" ${EXTRA:-} | tail -n 5
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ]; then
        z benchmark mlm --strategies ${S4:-${S2:-ddp,zero1,zero2}} --nproc 4 --out "$dir/4gpu" "${BERT[@]}" ${EXTRA:-} | tail -n 5
      fi ;;
    offload_5b)  # the fast-path issue's target 5(b): MLM 24 layers x 4096 (FFN 16384, 32 heads; 5.06B parameters),
      # ZeRO-2 + CPU optimizer offload, activation checkpointing, bf16, no evaluation, no export. The issue's
      # configuration (micro-batch 4), then micro-batches 32 and 48 (MB="4 32 48"): the CPU Adam step over 5B
      # parameters is paid once per step whatever the batch. Not accumulation: under offload DeepSpeed sums the
      # micro-batches in a second bf16 gradient copy on the host (+10 GB here), and micro-batch 16 x 4 outgrew
      # the 125 GiB host (session 8). No final checkpoint: 70 GB, more than the disk. PREDICT=true runs the memory
      # model's probe first and puts its predictions in the rows
      for mb in ${MB:-4 32 48}; do
        z benchmark mlm --strategies zero2_offload --predict ${PREDICT:-false} --out "$OUT/offload_5b/mb$mb" "${BIG[@]}" \
          --trainer.micro_batch_size "$mb" | tail -n 3
      done ;;
    offload_12b)  # target 5(a) on a host with room for it (the 125 GiB host of offload_5b holds ~5-6B at most): MLM
      # 60 layers x 4096 (FFN 16384, 32 heads; 12.31B parameters), full AdamW on the host (DeepSpeedCPUAdam), one GPU,
      # activation checkpointing, bf16, 6 steps; STRATS: zero2_offload (fp32 master, moments and gradients on the host),
      # zero3_offload (the bf16 weights too). No final checkpoint or export: ~200 GB. Predictions: `zerotrain estimate`
      for mb in ${MB:-32}; do
        timeout ${BIG_S:-560} python3 -m zerotrain benchmark mlm --strategies ${STRATS:-zero2_offload} --predict false \
          --out "$OUT/offload_12b/mb$mb" "${BIG[@]}" --model.num_layers ${LAYERS:-60} --trainer.micro_batch_size "$mb" \
          | tail -n 3
      done ;;
    offload_host125)  # target 5(a) on the issue's machine (125 GiB host, 64 GiB disk): the largest MLM x 4096 that
      # `zerotrain estimate --host_memory_gib 125` fits with ZeRO-2 + CPU offload once the offloaded states are not
      # pinned (LAYERS=32: 6.67B; pinned blocks round up to powers of two and hold ~5B at most), GPU capped at
      # GPU_GIB (an H100's 79 by default), 6 steps, host memory traced every 5 s
      mkdir -p "$OUT/offload_host125"
      (while sleep ${TRACE_S:-5}; do echo "$(date +%s) used_mib=$(free -m | awk '/Mem:/{print $3}') top_rss_mib=$(ps -eo rss= --sort=-rss | head -n 3 | awk '{printf "%d,", $1/1024}')"; done) > "$OUT/offload_host125/mem_trace_L${LAYERS:-32}.log" &
      trace=$!
      timeout ${BIG_S:-480} python3 -m zerotrain benchmark mlm --strategies zero2_offload --predict false \
        --out "$OUT/offload_host125/L${LAYERS:-32}_mb${MB:-16}" "${BIG[@]}" --model.num_layers ${LAYERS:-32} \
        --trainer.micro_batch_size ${MB:-16} --strategy.offload_pin_memory false --trainer.gpu_memory_gib ${GPU_GIB:-79} \
        | tail -n 3
      kill $trace ;;
    export_5b)  # target 5(c): offload_5b's model at micro-batch 96, then its end-of-run export (bf16 weights, ~10 GB)
      # with the host nearly full; predictions in the row from session 9's probe of this model (PROBE=file)
      z benchmark mlm --strategies zero2_offload --out "$OUT/export_5b" \
        --probe "${PROBE:-benchmarks/results/h100/session9/callD/offload_5b_mb96_probe.json}" "${BIG[@]}" \
        --trainer.micro_batch_size 96 --trainer.export true | tail -n 3
      grep -h "export" "$OUT"/export_5b/runs/*/fit.log 2>/dev/null | tail -n 20 ;;
    probe_5b)  # the memory model's probe of offload_5b's model at micro-batch up to 48: predictions for its rows
      # (benchmarks/repredict.py offload_5b_mbN_benchmark.json probe_5b.json)
      timeout ${PROBE_LIMIT:-400} python3 -m zerotrain.probe mlm --out "$OUT/probe_5b/probe_5b.json" --max_micro 48 \
        "${BIG[@]}" --trainer.micro_batch_size 48 \
        > "$OUT/probe_5b/probe.log" 2>&1; echo "probe 5b rc=$?"; tail -n 3 "$OUT/probe_5b/probe.log" ;;
    bert_compile)  # BERT-base on one GPU, ZeRO-0, for the MFU target: eager, then --compile.enabled true (its 12
      # encoder layers compiled one by one), in the same call
      z benchmark mlm --strategies zero0 --nproc 1 --predict false --out "$OUT/bert_compile/eager" "${BERT[@]}" | tail -n 3
      z benchmark mlm --strategies zero0 --nproc 1 --predict false --out "$OUT/bert_compile/compiled" "${BERT[@]}" \
        --compile.enabled true | tail -n 3 ;;
    bert_mfu)  # target 2 levers at BERT-base, compiled blocks, each a separate run in the same call: ZeRO-0 with the
      # aligned decoder (with a profile); ZeRO-1 through DeepSpeed's BF16_Optimizer (bf16 weights, fp32 master and
      # gradients; with a profile); ZeRO-0 with the code of OLD_SRC (the unaligned decoder) when given; dropout 0
      z benchmark mlm --strategies zero0 --nproc 1 --predict false --profile 5 --out "$OUT/bert_mfu/aligned" "${BERT[@]}" \
        --compile.enabled true | tail -n 3
      z benchmark mlm --strategies zero1 --nproc 1 --predict false --profile 5 --out "$OUT/bert_mfu/bf16_optimizer" \
        "${BERT[@]}" --compile.enabled true --strategy.deepspeed_config benchmarks/ds/zero1_bf16_fp32_grads.json | tail -n 3
      [ -n "${OLD_SRC:-}" ] && PYTHONPATH="${PYTHONPATH/$PWD\/src/$OLD_SRC}" z benchmark mlm --strategies zero0 --nproc 1 \
        --predict false --out "$OUT/bert_mfu/unaligned" "${BERT[@]}" --compile.enabled true | tail -n 3
      z benchmark mlm --strategies zero0 --nproc 1 --predict false --out "$OUT/bert_mfu/dropout0" "${BERT[@]}" \
        --compile.enabled true --model.dropout 0 | tail -n 3 ;;
    bert_decoder)  # the aligned decoder against OLD_SRC's unaligned one, ZeRO-0 compiled blocks, no profiler, twice in turn
      old_src_on_path || continue
      for rep in 1 2; do
        PYTHONPATH="${PYTHONPATH/$PWD\/src/$OLD_SRC}" z benchmark mlm --strategies zero0 --nproc 1 --predict false \
          --out "$OUT/bert_decoder/unaligned_$rep" "${BERT[@]}" --compile.enabled true | tail -n 1
        z benchmark mlm --strategies zero0 --nproc 1 --predict false --out "$OUT/bert_decoder/aligned_$rep" "${BERT[@]}" \
          --compile.enabled true | tail -n 1
      done ;;
    imdb_scope)  # target 3: preset (b), 2 epochs, training only: its blocks compiled one by one, then their stack as one graph
      for scope in blocks stack; do
        z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs 2 \
          --trainer.evaluate false --trainer.export false --checkpoint.save_final false --compile.enabled true \
          --compile.scope $scope --trainer.output_dir "$OUT/imdb_scope/runs" --trainer.run_name "$scope" \
          --logging.progress_bar false > "$OUT/imdb_scope/$scope.log" 2>&1
        echo "imdb scope=$scope rc=$?"; grep -h "torch.compile\|epoch" "$OUT/imdb_scope/$scope.log" | tail -n 4
      done ;;
    host)  # where a step's host time goes, profiled (5 steps each): IMDB preset (b) for 500 steps, profile at 400,
      # as shipped in session 11, with CUDA graphs and on the plain engine; then BERT-base ZeRO-0 with its blocks
      # compiled one by one and its encoder as one graph
      for v in "ds default" "ds reduce-overhead" "ddp default"; do
        set -- $v; name="imdb_$1_$2"
        timeout 200 python3 -m zerotrain fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" \
          --trainer.max_steps 500 --trainer.profile_steps 5 --trainer.warmup_steps_excluded 400 --trainer.evaluate false \
          --trainer.export false --checkpoint.save_final false --compile.mode $2 \
          $([ $1 = ddp ] && echo --strategy.backend ddp) --trainer.output_dir "$OUT/host/runs" --trainer.run_name $name \
          --logging.progress_bar false > "$OUT/host/$name.log" 2>&1
        echo "$name rc=$?"; grep -h "Error\|torch.compile" "$OUT/host/$name.log" | tail -n 2; head -n 1 "$OUT/host/runs/$name/profile.md"
        cp "$OUT/host/runs/$name/profile.md" "$OUT/host/${name}_profile.md"
        cp "$OUT/host/runs/$name/metrics.jsonl" "$OUT/host/${name}_metrics.jsonl"
      done
      for v in "blocks default" "stack default"; do  # blocks as CUDA graphs did not finish in time (bert_graphs)
        set -- $v
        timeout 200 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --predict false --profile 5 \
          --out "$OUT/host/bert_$1_$2" "${BERT[@]}" --compile.enabled true --compile.scope $1 \
          --compile.mode $2 | tail -n 1
      done ;;
    bert_graphs)  # target 2 at BERT-base, ZeRO-0, in one call: the encoder compiled as one graph, then replayed as a
      # CUDA graph (with a profile). The blocks one by one as CUDA graphs did not finish 120 steps in 170 s (session 12).
      for v in "stack default 0" "stack reduce-overhead 5"; do
        set -- $v
        timeout 170 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --predict false --profile $3 \
          --out "$OUT/bert_graphs/$1_$2" "${BERT[@]}" --compile.enabled true --compile.scope $1 \
          --compile.mode $2 | tail -n 1
      done ;;
    bert_head)  # the MLM head finding its masked positions once (this code) against twice (OLD_SRC), ZeRO-0 with the
      # encoder compiled as one graph, no profiler, twice in turn
      old_src_on_path || continue
      for rep in 1 2; do
        PYTHONPATH="${PYTHONPATH/$PWD\/src/$OLD_SRC}" timeout 140 python3 -m zerotrain benchmark mlm --strategies zero0 \
          --nproc 1 --predict false --out "$OUT/bert_head/twice_$rep" "${BERT[@]}" --compile.enabled true \
          --compile.scope stack | tail -n 1
        timeout 140 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --predict false \
          --out "$OUT/bert_head/once_$rep" "${BERT[@]}" --compile.enabled true --compile.scope stack | tail -n 1
      done ;;
    bert_sync)  # the MLM step handed its masked positions by the data pipeline (this code) against the head finding
      # them on the GPU with one wait a step (OLD_SRC), ZeRO-0, encoder compiled as one graph, 5 steps profiled
      # after the timed ones' warm-up (not part of the timing), twice in turn
      old_src_on_path || continue
      for rep in 1 2; do
        PYTHONPATH="${PYTHONPATH/$PWD\/src/$OLD_SRC}" timeout 140 python3 -m zerotrain benchmark mlm --strategies zero0 \
          --nproc 1 --predict false --profile 5 --out "$OUT/bert_sync/found_$rep" "${BERT[@]}" --compile.enabled true \
          --compile.scope stack | tail -n 1
        timeout 140 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --predict false --profile 5 \
          --out "$OUT/bert_sync/handed_$rep" "${BERT[@]}" --compile.enabled true --compile.scope stack | tail -n 1
      done ;;
    sync_sites)  # who makes the host wait inside a training step (benchmarks/sync_sites.py): BERT-base on NP GPUs
      # (default 2), 30 steps, each strategy of SYNC (default zero1 ddp), encoder compiled as one graph
      for s in ${SYNC:-zero1 ddp}; do
        case $s in ddp) f=(--strategy.backend ddp) ;; *) f=(--strategy.backend deepspeed --strategy.zero_stage "${s#zero}") ;; esac
        timeout 200 torchrun --nproc_per_node "${NP:-2}" benchmarks/sync_sites.py "$OUT/sync_sites/$s.json" fit mlm "${BERT[@]}" \
          "${f[@]}" --trainer.max_steps 30 --trainer.output_dir "/tmp/sync_sites_$s" --compile.enabled true \
          --compile.scope stack > "$OUT/sync_sites/$s.log" 2>&1
        echo "sync_sites $s rc=$?"; grep "^rank 0:" "$OUT/sync_sites/$s.log" | head -n 8
      done ;;
    scaling_sync)  # target 4 (and 1) after session 14 took the host-device waits out of the ZeRO step (DeepSpeed's
      # norm mask; the loss-weight read it also removed is LoRA's, not MLM's): the fastest one-GPU engine and ZeRO-1 on one GPU,
      # 2 x ZeRO-1 with this code, then with OLD_SRC's (the waits in), all with the encoder as one CUDA-graphed
      # unit; OVERLAP=1 adds blocks compiled one by one with overlap_comm, so the reduction can overlap the backward
      old_src_on_path || continue
      G=(--compile.enabled true --compile.mode reduce-overhead --predict false)
      z benchmark mlm --strategies ${S1:-ddp,zero1} --nproc 1 --out "$OUT/scaling_sync/1gpu" "${BERT[@]}" "${G[@]}" \
        --compile.scope stack | tail -n 2
      z benchmark mlm --strategies zero1 --nproc 2 --out "$OUT/scaling_sync/2gpu" "${BERT[@]}" "${G[@]}" \
        --compile.scope stack | tail -n 1
      old python3 -m zerotrain benchmark \
        mlm --strategies zero1 --nproc 2 --out "$OUT/scaling_sync/2gpu_old" "${BERT[@]}" "${G[@]}" \
        --compile.scope stack | tail -n 1
      if [ "${OVERLAP:-0}" = 1 ]; then
        z benchmark mlm --strategies zero1 --nproc 2 --out "$OUT/scaling_sync/2gpu_blocks_overlap" "${BERT[@]}" "${G[@]}" \
          --compile.scope blocks --strategy.overlap_comm true --strategy.reduce_bucket_size 50000000 | tail -n 1
      fi ;;
    scaling_rs)  # target 4: 2 x ZeRO-1 reducing by reduce-scatter into each rank's partition (this code) against
      # DeepSpeed's all-reduce and copy-back (OLD_SRC), in turn (new, old, new), after the fastest one-GPU engine;
      # the encoder as one CUDA-graphed unit; the first 2-GPU row also takes a 10-step profile
      old_src_on_path || continue
      G=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false
         --trainer.export false)
      z benchmark mlm --strategies ${S1:-ddp} --nproc 1 --out "$OUT/scaling_rs/1gpu" "${BERT[@]}" "${G[@]}" | tail -n 2
      z benchmark mlm --strategies zero1 --nproc 2 --out "$OUT/scaling_rs/2gpu_new1" "${BERT[@]}" "${G[@]}" \
        --profile 10 | tail -n 1
      old python3 -m zerotrain benchmark mlm --strategies zero1 --nproc 2 --out "$OUT/scaling_rs/2gpu_old" \
        "${BERT[@]}" "${G[@]}" | tail -n 1
      z benchmark mlm --strategies zero1 --nproc 2 --out "$OUT/scaling_rs/2gpu_new2" "${BERT[@]}" "${G[@]}" | tail -n 1 ;;
    scaling_rounds)  # target 4 on one machine: rows in the order ROWS gives, each the GPU count (default: the fastest
      # one-GPU engine S1 (ddp) and 2 x ZeRO-1, in turn, twice); EXTRA adds flags to every row
      G=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false
         --trainer.export false)
      i=0
      for n in ${ROWS:-1 2 2 1}; do
        i=$((i + 1))
        if [ "$n" = 1 ]; then s=${S1:-ddp}; else s=zero1; fi
        z benchmark mlm --strategies $s --nproc $n --out "$OUT/scaling_rounds/r${i}_${n}gpu" "${BERT[@]}" "${G[@]}" \
          ${EXTRA:-} | tail -n 1
      done ;;
    scaling_gc)  # target 4's rows with Python's heap frozen after the warm-up (--trainer.gc_freeze true, the
      # default) and not, in turn on one machine: ROWS lists GPUS:FREEZE per row; each row's summary carries every
      # rank's garbage-collection time (gc_ms_per_step_all_ranks), to tell a rank's long collection from other stalls
      G=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false
         --trainer.export false)
      i=0
      for row in ${ROWS:-4:false 4:true 4:false 4:true}; do
        i=$((i + 1)); n=${row%%:*}; f=${row#*:}; [ "$f" = "$row" ] && f=true  # no ":": the default
        if [ "$n" = 1 ]; then s=${S1:-ddp}; else s=zero1; fi
        z benchmark mlm --strategies $s --nproc $n --out "$OUT/scaling_gc/r${i}_${n}gpu_freeze_$f" "${BERT[@]}" \
          "${G[@]}" --trainer.gc_freeze $f | tail -n 1
      done ;;
    bert_loss)  # the MLM loss compiled on its own (inductor's fused cross-entropy, this code) against eager (OLD_SRC),
      # ZeRO-0, encoder as one CUDA-graphed graph, 5 steps profiled after the timed ones' warm-up, twice in turn
      old_src_on_path || continue
      G=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false)
      for rep in 1 2; do
        old timeout 150 python3 -m \
          zerotrain benchmark mlm --strategies zero0 --nproc 1 --profile 5 --out "$OUT/bert_loss/eager_$rep" "${BERT[@]}" \
          "${G[@]}" | tail -n 1
        timeout 150 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --profile 5 \
          --out "$OUT/bert_loss/fused_$rep" "${BERT[@]}" "${G[@]}" | tail -n 1
      done ;;
    bert_ln)  # the MLM's LayerNorm returning autocast's bf16 (this code) against torch's float32 (OLD_SRC): ZeRO-0,
      # the encoder as one CUDA-graphed graph, 200 steps each in turn, profiled, with the loss curves compared;
      # then this code at micro-batch 64 (the GPU holds 7-7.6 GiB at 32)
      old_src_on_path || continue
      G=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false
         --trainer.max_steps 200)
      old timeout 200 python3 -m \
        zerotrain benchmark mlm --strategies zero0 --nproc 1 --profile 5 --out "$OUT/bert_ln/fp32_ln" "${BERT[@]}" \
        "${G[@]}" | tail -n 1
      timeout 200 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --profile 5 \
        --out "$OUT/bert_ln/bf16_ln" "${BERT[@]}" "${G[@]}" | tail -n 1
      python3 benchmarks/loss_curves.py "$OUT/bert_ln/curves.json" "$OUT/bert_ln/bf16_ln" "$OUT/bert_ln/fp32_ln"
      timeout 200 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --profile 5 \
        --out "$OUT/bert_ln/bf16_ln_mb64" "${BERT[@]}" "${G[@]}" --trainer.micro_batch_size 64 | tail -n 1 ;;
    bert_mb)  # target 2 by micro-batch: ZeRO-0 and ZeRO-1 (BERT_STRATS) at 128 and 64 (MBS) sequences of 512, encoder CUDA-graphed,
      # profiled; then the bert_ln pair again at 32 (OLD_SRC: torch's float32 LayerNorm) in the other order
      G=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false)
      for mb in ${MBS:-128 64}; do
        timeout 230 python3 -m zerotrain benchmark mlm --strategies ${BERT_STRATS:-zero0,zero1} --nproc 1 --profile 5 \
          --out "$OUT/bert_mb/mb$mb" "${BERT[@]}" "${G[@]}" --trainer.micro_batch_size $mb | tail -n 3
      done
      old_src_on_path || continue
      timeout 120 python3 -m zerotrain benchmark mlm --strategies zero0 --nproc 1 --out "$OUT/bert_mb/bf16_ln_mb32" \
        "${BERT[@]}" "${G[@]}" | tail -n 1
      old timeout 120 python3 -m \
        zerotrain benchmark mlm --strategies zero0 --nproc 1 --out "$OUT/bert_mb/fp32_ln_mb32" "${BERT[@]}" \
        "${G[@]}" | tail -n 1 ;;
    tests)
      z doctor > "$OUT/tests/doctor.txt" 2>&1
      python3 -m pytest -m gpu -q tests/test_gpu.py > "$OUT/tests/pytest_gpu.txt" 2>&1; echo "pytest -m gpu: rc=$?" ;;
    mlm)  # HelloDeepSpeed's model (6 layers, 8 heads, h 256, ff 512, seq 512), micro-batch 8, bf16
      z benchmark mlm --strategies zero1_offload,zero0,zero1,zero2,zero3 --out "$OUT/mlm" \
        --data.train_path "$D/gutenberg/train.txt.xz" --data.val_path "$D/gutenberg/validation.txt.xz" \
        --data.tokenizer "$TOK" --data.max_train_lines 40000 --data.max_val_lines 2000 \
        --trainer.micro_batch_size 8 --trainer.max_steps 300 --trainer.log_every_steps 50 \
        --trainer.warmup_steps_excluded 20 --trainer.eval_max_batches 50 --precision.dtype bf16 \
        --scheduler.name warmup_linear --scheduler.warmup_steps 30 --optimizer.lr 1e-4 | tail -n 12 ;;
    fastpath)  # BERT-base-shaped MLM, micro-batch 32 x 512, bf16, one GPU: the plain engine, ZeRO-0/1/2 with
      # the fast path, and ZeRO-0/1/2 with DeepSpeed's defaults (--strategy.fast_path false), same data and seed
      z benchmark mlm --strategies ddp,zero0,zero1,zero2 --out "$OUT/fastpath/fast" "${BERT[@]}" | tail -n 6
      z benchmark mlm --strategies zero0,zero1,zero2 --out "$OUT/fastpath/defaults" "${BERT[@]}" \
        --strategy.fast_path false | tail -n 5
      python3 benchmarks/loss_curves.py "$OUT/fastpath/loss_curves.json" "$OUT/fastpath/fast" "$OUT/fastpath/defaults" ;;
    fastpath_profile)  # the same model: where ZeRO-1/2's time goes, and torch.compile on the plain engine and ZeRO-0
      z benchmark mlm --strategies ddp,zero0,zero1,zero2 --profile 5 --out "$OUT/fastpath_profile/eager" "${BERT[@]}" | tail -n 6
      z benchmark mlm --strategies ddp,zero0 --profile 5 --out "$OUT/fastpath_profile/compiled" "${BERT[@]}" \
        --compile.enabled true | tail -n 4 ;;
    imdb_peer)  # preset (b) as shipped (ZeRO-0, fast path), 5 epochs, seed 42, then the tutorial's Lightning
      # script (PEER=path, default .data/peers/tutorial_imdb_lightning.py) for one full epoch on the same GPU
      z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" \
        --trainer.output_dir "$OUT/imdb_peer/runs" --trainer.run_name zerotrain_b --logging.progress_bar false \
        > "$OUT/imdb_peer/zerotrain_b.log" 2>&1; echo "zerotrain rc=$?"; grep -h "test_acc\|test:" "$OUT/imdb_peer/zerotrain_b.log"
      python3 "${PEER:-$D/peers/tutorial_imdb_lightning.py}" "$D/imdb" "$TOK" auto 1 0 1 > "$OUT/imdb_peer/lightning.log" 2>&1
      echo "lightning rc=$?"; grep -h "SEED_RESULT" "$OUT/imdb_peer/lightning.log" ;;
    lora_tokens)  # LoRA 1.2B, the tutorial's ZeRO-2+offload JSON: zerotrain with and without length-grouped
      # batches, and the HF Trainer, in one run on one GPU; non-padding tokens/s counted in both loops
      sft; FLAGS=("${LORA[@]}" --trainer.max_steps 30 --trainer.log_every_steps 5 --trainer.warmup_steps_excluded 5
                 --scheduler.warmup_steps 5 --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json)
      z benchmark lora --strategies zero2 --out "$OUT/lora_tokens/bucketed" "${FLAGS[@]}" --data.bucket_by_length true | tail -n 3
      z benchmark lora --strategies zero2 --out "$OUT/lora_tokens/plain" "${FLAGS[@]}" | tail -n 3
      python3 benchmarks/hf_trainer_lora.py --out "$OUT/lora_tokens/hf_trainer.json" --warmup 5 -- "${FLAGS[@]}" \
        > "$OUT/lora_tokens/hf_trainer.log" 2>&1; echo "hf_trainer rc=$?"; tail -n 20 "$OUT/lora_tokens/hf_trainer.log" ;;
    imdb_b)  # the tutorial's preset (b), full data, 5 epochs, one GPU per run; three seeds spread over the GPUs
      n=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))'); seeds=(42 43 44)
      for g in $(seq 0 $((n - 1))); do
        ( for i in "${!seeds[@]}"; do
            [ $((i % n)) -eq "$g" ] || continue; s=${seeds[$i]}
            CUDA_VISIBLE_DEVICES=$g z fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" \
              --trainer.output_dir "$OUT/imdb_b/runs" --trainer.run_name "seed$s" --trainer.seed "$s" \
              --strategy.zero_stage 0 --logging.progress_bar false > "$OUT/imdb_b/seed$s.log" 2>&1
            echo "imdb_b seed $s rc=$?"; cp "$OUT/imdb_b/runs/seed$s/summary.json" "$OUT/imdb_b/seed${s}_summary.json"
          done ) &
      done; wait
      grep -h "test_acc" "$OUT"/imdb_b/seed*.log ;;
    imdb_sweep)  # the tutorial's comparison: preset (b), 500 steps per strategy, the first 100 untimed
      z benchmark imdb --strategies ddp,zero0,zero1,zero2,zero3,zero2_offload --nproc 1 --out "$OUT/imdb_sweep1" \
        --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.max_steps 500 \
        --trainer.warmup_steps_excluded 100 --trainer.eval_max_batches 20 | tail -n 10
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        z benchmark imdb --strategies ddp,zero1,zero2 --nproc 2 --out "$OUT/imdb_sweep2" \
          --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.max_steps 500 \
          --trainer.warmup_steps_excluded 100 --trainer.eval_max_batches 20 | tail -n 6
      fi ;;
    lora|lora_hf)  # ~1.2B Llama from a config, LoRA r=8 on q/v, bf16, 512-token IMDB prompts
      sft; FLAGS=("${LORA[@]}" --trainer.max_steps 25 --trainer.log_every_steps 5 --trainer.warmup_steps_excluded 5 --scheduler.warmup_steps 5)
      mkdir -p "$OUT/lora"
      [ $part = lora ] && z benchmark lora --strategies zero2,zero3 --out "$OUT/lora" "${FLAGS[@]}" | tail -n 6
      [ $part = lora ] && z benchmark lora --strategies zero2 --out "$OUT/lora_offload" "${FLAGS[@]}" \
        --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json | tail -n 4
      python3 benchmarks/hf_trainer_lora.py --out "$OUT/lora/hf_trainer.json" --warmup 5 -- "${FLAGS[@]}" \
        --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json > "$OUT/lora/hf_trainer.log" 2>&1
      echo "hf_trainer rc=$?"; tail -n 12 "$OUT/lora/hf_trainer.log" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
