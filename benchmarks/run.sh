#!/usr/bin/env bash
# Reproduces the result pages in docs/benchmarks/, one part per page. Run from the repository root on a GPU
# machine:   bash benchmarks/run.sh PART [PART ...]   (results go to ${OUT:-/tmp/zerotrain-bench}/PART/)
#
# Data: DATA (default .data) holds imdb/ (train.jsonl.gz, test.jsonl.gz), roberta-tokenizer/ (a Hugging Face
# tokenizer folder, e.g. a save_pretrained copy of FacebookAI/roberta-base's) and gutenberg/ (train.txt.xz,
# validation.txt.xz: one paragraph of text a line). The imdb part also needs the DeepSpeed tutorial's Lightning
# script for IMDB, given as PEER=path.
#
# causal_lm_1b also needs DATA/tok32k, a 32,000-token tokenizer: python3 benchmarks/make_tokenizer.py
# DATA/gutenberg/train.txt.xz DATA/tok32k.
#
# Parts: imdb | engine_overhead | mlm_bert_base | scaling | lora | causal_lm_1b | causal_lm_8b (4 GPUs) | multinode (2 or 4
#        GPUs) | sft_packing | offload_large_model | offload_5b | offload_7b |
#        offload_7b_host125 | state_precision (CPU) | engines | planner | kill_test (CPU) |
#        restart_test (CPU) | gpu_tests
#
# sft_packing also needs DATA/tok32k; SIZE=tiny runs it on a 2-layer model and 32 conversations (CPU), to check the
# part end to end; ROWS="full_packed lora_padded" runs only those rows (the table marks the others missing).
# SFT_CONVERSATIONS=N trains on N conversations (default 8000).
set -uo pipefail
OUT=${OUT:-/tmp/zerotrain-bench}
D=${DATA:-.data}
TOK=$D/roberta-tokenizer
z() { python3 -m zerotrain "$@"; }

# MLM at BERT-base shape (12 layers, 768 wide, 12 heads, FFN 3072, seq 512), micro-batch 32, bf16, Gutenberg text
BERT=(--data.train_path "$D/gutenberg/train.txt.xz" --data.val_path "$D/gutenberg/validation.txt.xz"
      --data.tokenizer "$TOK" --data.max_train_lines 60000 --data.max_val_lines 2000
      --model.num_layers 12 --model.num_heads 12 --model.h_dim 768 --model.ff_dim 3072 --model.max_seq_length 512
      --trainer.micro_batch_size 32 --trainer.max_steps 120 --trainer.log_every_steps 10
      --trainer.warmup_steps_excluded 20 --trainer.eval_max_batches 4 --trainer.eval_every_steps 100000
      --precision.dtype bf16 --scheduler.name warmup_linear --scheduler.warmup_steps 20 --optimizer.lr 1e-4
      --checkpoint.save_final false)
# The encoder compiled as one graph and replayed as CUDA graphs
GRAPHS=(--compile.enabled true --compile.scope stack --compile.mode reduce-overhead --predict false)
# MLM x 4096 wide (FFN 16384, 32 heads), activation checkpointing, 6 steps (2 untimed), no evaluation or export
BIG=("${BERT[@]}" --model.h_dim 4096 --model.ff_dim 16384 --model.num_heads 32
     --activation_checkpointing.enabled true --trainer.max_steps 6 --trainer.warmup_steps_excluded 2
     --trainer.log_every_steps 1 --scheduler.warmup_steps 1 --trainer.evaluate false --trainer.export false)
# LoRA on the 1.2B Llama-style model of configs/llama_1b_config.json (random weights), 2,000 IMDB prompts
LORA=(--model.init random --model.config configs/llama_1b_config.json --model.tokenizer "$TOK"
      --data.train_path "$OUT/sft.jsonl" --data.max_length 512 --trainer.micro_batch_size 4
      --precision.dtype bf16 --optimizer.lr 2e-4 --trainer.num_workers 2 --checkpoint.save_final false)
# causal-lm, Llama-shaped 1.1B (configs/llama_1.1b_config.json, random weights), rows of 2,048 Gutenberg tokens, bf16,
# full AdamW, micro-batch 8, 40 steps of which the first 15 are not timed; no evaluation, export or final save
LLAMA=(--model.init random --model.config configs/llama_1.1b_config.json --model.tokenizer "$D/tok32k"
       --data.train_path "$D/gutenberg/train.txt.xz" --data.format text --data.seq_len 2048 --data.max_train_lines 30000
       --data.cache_dir "$OUT/cache" --precision.dtype bf16 --optimizer.lr 3e-4 --scheduler.warmup_steps 5
       --trainer.micro_batch_size 8 --trainer.max_steps 40 --trainer.warmup_steps_excluded 15 --trainer.log_every_steps 5
       --trainer.evaluate false --trainer.export false --checkpoint.save_final false --logging.progress_bar false)
# SFT on chat records (IMDB reviews as two-turn conversations, rendered by benchmarks/chat_template.jinja: tok32k has
# no chat template), Llama-shaped 1.1B (random weights), bf16, ZeRO-2 (STRATEGY=...), micro-batch 8, eager; one pass over the same
# conversations in every row (the same non-padding tokens), the loss on held-out conversations (IMDB's test split)
# at its end. SIZE=tiny: a 2-layer, 64-wide Llama in fp32, 32 conversations, rows of 128 tokens (a CPU check).
if [ "${SIZE:-}" = tiny ]; then
  SFT_N=(32 8 400); SFT_MODEL=$OUT/sft_packing/llama_tiny_config.json; SFT_SEQ=128; SFT_MICRO=4; SFT_WARM=1; SFT_LRWARM=2
  SFT_PRECISION=fp32
else
  SFT_N=("${SFT_CONVERSATIONS:-8000}" 500 6000); SFT_MODEL=configs/llama_1.1b_config.json; SFT_SEQ=2048; SFT_MICRO=8; SFT_WARM=10; SFT_LRWARM=5
  SFT_PRECISION=bf16
fi
SFT=(--model.init random --model.config "$SFT_MODEL" --model.tokenizer "$D/tok32k"
     --data.train_path "$OUT/sft_packing/chat_train.jsonl" --data.val_path "$OUT/sft_packing/chat_val.jsonl"
     --data.format chat --data.chat_template benchmarks/chat_template.jinja --data.seq_len "$SFT_SEQ"
     --data.cache_dir "$OUT/cache" --precision.dtype "$SFT_PRECISION" --scheduler.name warmup_linear --scheduler.warmup_steps "$SFT_LRWARM"
     --trainer.micro_batch_size "$SFT_MICRO" --trainer.epochs 1 --trainer.warmup_steps_excluded "$SFT_WARM"
     --trainer.log_every_steps 5 --trainer.eval_every_steps 0 --trainer.export false --checkpoint.save_final false
     --logging.progress_bar false)
# Llama-shaped 6.74B (configs/llama_7b_config.json, random weights), full AdamW, activation checkpointing, micro-batch 48
L7=(--model.init random --model.config configs/llama_7b_config.json --model.tokenizer "$D/tok32k"
    --data.train_path "$D/gutenberg/train.txt.xz" --data.format text --data.seq_len 2048 --data.max_train_lines 30000
    --data.cache_dir "$OUT/cache" --precision.dtype bf16 --optimizer.lr 3e-4 --scheduler.warmup_steps 2
    --trainer.micro_batch_size 48 --activation_checkpointing.enabled true --trainer.max_steps 5
    --trainer.warmup_steps_excluded 2 --trainer.log_every_steps 1 --trainer.evaluate false --trainer.export false
    --checkpoint.save_final false --logging.progress_bar false)
plan() {  # plan NAME RECIPE FLAGS...: the planner's pick against every listed strategy, measured on this machine;
  # TRIALS (default 3): the planner's own trials
  local name=$1; shift
  z plan "$@" --out "$OUT/planner/$name" --compare_strategies --trials "${TRIALS:-3}" > "$OUT/planner/$name.log" 2>&1
  echo "plan $name rc=$?"
}

for part in "$@"; do
  mkdir -p "$OUT/$part"
  case $part in
    imdb)  # IMDB preset (b), 5 epochs with its test score, then the tutorial's Lightning script for one epoch
      ZCMD=(python3 -m zerotrain fit imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK"
            --trainer.export false --checkpoint.save_final false --trainer.output_dir "$OUT/imdb/runs"
            --trainer.run_name preset_b --logging.progress_bar false)
      LCMD=(python3 "${PEER:?PEER=path to the tutorial Lightning script}" "$D/imdb" "$TOK" auto 1 0 1)
      "${ZCMD[@]}" > "$OUT/imdb/zerotrain.log" 2>&1; echo "zerotrain rc=$?"
      "${LCMD[@]}" > "$OUT/imdb/lightning.log" 2>&1; echo "lightning rc=$?"
      python3 benchmarks/imdb_vs_lightning.py --run "$OUT/imdb/runs/preset_b" --lightning_log "$OUT/imdb/lightning.log" \
        --out "$OUT/imdb/imdb_vs_lightning" --zerotrain_command "${ZCMD[*]}" --lightning_command "${LCMD[*]}" ;;
    engine_overhead)  # IMDB (b) on one GPU: plain PyTorch and ZeRO-0/1/2, 3 epochs each (the last 2 timed), in
      # ROUNDS rounds of alternating order; the benchmark reports each engine's median tax against plain
      z benchmark imdb --strategies ddp,zero0,zero1,zero2 --nproc 1 --out "$OUT/engine_overhead" \
        --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trainer.epochs 3 \
        --trainer.warmup_steps_excluded 781 --trainer.evaluate false --trainer.export false \
        --checkpoint.save_final false --predict false --rounds "${ROUNDS:-4}" | tail -n 20 ;;
    mlm_bert_base)  # BERT-base MLM through ZeRO-0 at micro-batch 128, 5 steps profiled
      z benchmark mlm --strategies zero0 --nproc 1 --profile 5 --out "$OUT/mlm_bert_base" "${BERT[@]}" "${GRAPHS[@]}" \
        --trainer.micro_batch_size 128 | tail -n 3 ;;
    scaling)  # BERT-base on 1, 2 and 4 GPUs in turn (plain PyTorch on one GPU, ZeRO-1 on several)
      i=0
      for n in ${ROWS:-4 1 2 4 1 2 4 1}; do
        i=$((i + 1)); if [ "$n" = 1 ]; then s=ddp; else s=zero1; fi
        z benchmark mlm --strategies $s --nproc "$n" --out "$OUT/scaling/r${i}_${n}gpu" "${BERT[@]}" "${GRAPHS[@]}" \
          --trainer.export false | tail -n 1
      done ;;
    lora)  # LoRA 1.2B, the tutorial's ZeRO-2 + CPU-offload JSON: zerotrain compiled and length-grouped, then the
      # Hugging Face Trainer with the same model, data and JSON; non-padding tokens/s in both
      python3 benchmarks/make_sft_data.py "$D/imdb/train.jsonl.gz" "$OUT/sft.jsonl" --n 2000
      FLAGS=("${LORA[@]}" --trainer.max_steps 120 --trainer.log_every_steps 10 --trainer.warmup_steps_excluded 40
             --scheduler.warmup_steps 5 --strategy.deepspeed_config src/zerotrain/presets/ds_zero2_offload.json)
      z benchmark lora --strategies zero2 --predict false --out "$OUT/lora/compiled" "${FLAGS[@]}" \
        --compile.enabled true --data.bucket_by_length true --data.pad_to_multiple_of 64 | tail -n 3
      python3 benchmarks/hf_trainer.py --recipe lora --out "$OUT/lora/hf_trainer.json" --warmup 40 -- "${FLAGS[@]}" \
        > "$OUT/lora/hf_trainer.log" 2>&1; echo "hf_trainer rc=$?"; tail -n 8 "$OUT/lora/hf_trainer.log" ;;
    causal_lm_1b)  # zerotrain's causal-lm (GPU CUDA_A) beside the Hugging Face Trainer (GPU CUDA_B) on one model and
      # data; zerotrain: DeepSpeed ZeRO-1/2, eager or compiled block by block, its attention choices for packed
      # rows; the Trainer: the ZeRO-2 JSON a user writes (ds_zero2_auto.json), with torch_compile, and alone at its best
      C=$OUT/causal_lm_1b
      zb() { local name=$1 stage=$2; shift 2; CUDA_VISIBLE_DEVICES=${CUDA_A:-0} z benchmark causal-lm --strategies "$stage" \
        --predict false --out "$C/$name" "${LLAMA[@]}" "$@" > "$C/$name.log" 2>&1; echo "$name rc=$?"; }
      hf() { local name=$1 args=$2; shift 2; CUDA_VISIBLE_DEVICES=${CUDA_B:-0} python3 benchmarks/hf_trainer.py \
        --recipe causal-lm --out "$C/$name.json" --warmup 15 --trainer_args "$args" -- "${LLAMA[@]}" "$@" \
        --data.cache_dir "$OUT/cache_hf" > "$C/$name.log" 2>&1; echo "$name rc=$?"; }
      COMPILED=(--compile.enabled true)
      ( zb zero2_eager zero2 --model.attn_implementation sdpa
        zb zero1_compiled_sdpa zero1 "${COMPILED[@]}" --model.attn_implementation sdpa
        zb zero1_compiled zero1 "${COMPILED[@]}"
        zb zero2_compiled zero2 "${COMPILED[@]}"
        zb zero1_compiled_rowmask zero1 "${COMPILED[@]}" --data.document_mask false ) &
      ( hf hf_zero2 '{}' --strategy.deepspeed_config benchmarks/ds_zero2_auto.json
        hf hf_zero2_compile '{"torch_compile": true}' --strategy.deepspeed_config benchmarks/ds_zero2_auto.json
        hf hf_alone_compile '{"torch_compile": true, "optim": "adamw_torch_fused"}'
        hf hf_alone_liger '{"use_liger_kernel": true, "optim": "adamw_torch_fused"}' ) &
      wait
      python3 benchmarks/compare_rows.py --out "$C/causal_lm_1b" \
        --title "Llama-shaped 1.1B, seq 2048, bf16, AdamW, micro-batch 8, one GPU each" \
        --zerotrain "zerotrain ZeRO-2, eager, sdpa + document mask=$C/zero2_eager/benchmark.json" \
        --zerotrain "zerotrain ZeRO-1, compiled, sdpa + document mask=$C/zero1_compiled_sdpa/benchmark.json" \
        --zerotrain "zerotrain ZeRO-1, compiled (default attention: flex)=$C/zero1_compiled/benchmark.json" \
        --zerotrain "zerotrain ZeRO-2, compiled (default attention: flex)=$C/zero2_compiled/benchmark.json" \
        --zerotrain "zerotrain ZeRO-1, compiled, one causal mask a row=$C/zero1_compiled_rowmask/benchmark.json" \
        --peer "HF Trainer + ZeRO-2 JSON=$C/hf_zero2.json" --peer "HF Trainer + ZeRO-2 JSON, torch_compile=$C/hf_zero2_compile.json" \
        --peer "HF Trainer alone, torch_compile, fused AdamW=$C/hf_alone_compile.json" \
        --peer "HF Trainer alone, Liger kernels, fused AdamW=$C/hf_alone_liger.json" | tail -n 16 ;;
    causal_lm_8b)  # four GPUs: Llama-shaped 8B (configs/llama_8b_config.json), seq 4096, ZeRO-3, bf16, AdamW, micro-batch
      # MB (default 2); zerotrain eager (compiling under ZeRO-3 had not finished after 7 minutes), then the Hugging Face
      # Trainer with the ZeRO-3 JSON a user writes (ds_zero3_auto.json) through torchrun, on the same model and data
      C=$OUT/causal_lm_8b
      L8=("${LLAMA[@]}" --model.config configs/llama_8b_config.json --data.seq_len 4096 --trainer.micro_batch_size
          "${MB:-2}" --trainer.max_steps 25 --trainer.warmup_steps_excluded 10)
      z benchmark causal-lm --strategies zero3 --nproc 4 --predict false --out "$C/zero3" "${L8[@]}" \
        > "$C/zero3.log" 2>&1; echo "zero3 rc=$?"
      python3 -m torch.distributed.run --nproc-per-node 4 benchmarks/hf_trainer.py --recipe causal-lm \
        --out "$C/hf_zero3.json" --warmup 10 -- "${L8[@]}" --strategy.deepspeed_config benchmarks/ds_zero3_auto.json \
        --data.cache_dir "$OUT/cache_hf" > "$C/hf_zero3.log" 2>&1; echo "hf_zero3 rc=$?"
      python3 benchmarks/compare_rows.py --out "$C/causal_lm_8b" \
        --title "Llama-shaped 8B, seq 4096, bf16, AdamW, ZeRO-3, micro-batch ${MB:-2}, four GPUs" \
        --zerotrain "zerotrain ZeRO-3=$C/zero3/benchmark.json" \
        --peer "HF Trainer + ZeRO-3 JSON=$C/hf_zero3.json" | tail -n 6 ;;
    multinode)  # two launchers of half the GPUs each (two nodes) against one launcher with all of them, over NCCL:
      # BERT-base MLM in bf16 and fp32, then the 1.1B causal LM under ZeRO-3 checkpointed on two nodes and resumed on one
      M=$OUT/multinode
      python3 benchmarks/multinode.py --out "$M/bert_base_bf16" --title "BERT-base MLM, bf16, ZeRO-1: two nodes \
against one" -- mlm "${BERT[@]}" --strategy.zero_stage 1 --trainer.max_steps 60 --trainer.export false | tail -n 4
      python3 benchmarks/multinode.py --out "$M/bert_base_fp32" --title "BERT-base MLM, fp32, ZeRO-1: two nodes \
against one" -- mlm "${BERT[@]}" --strategy.zero_stage 1 --precision.dtype fp32 --trainer.max_steps 20 \
        --trainer.warmup_steps_excluded 5 --scheduler.warmup_steps 5 --trainer.export false | tail -n 4
      python3 benchmarks/multinode.py --resume --out "$M/llama_1b_zero3" --title "Llama-shaped 1.1B, bf16, ZeRO-3: \
two nodes against one, and a resume from two nodes on one" -- causal-lm "${LLAMA[@]}" --strategy.zero_stage 3 \
        --trainer.max_steps 20 --trainer.warmup_steps_excluded 5 --trainer.micro_batch_size 4 | tail -n 6 ;;
    sft_packing)  # chat SFT packed (--data.pack true, documents kept apart) against padded per batch (--data.pack
      # false), and padded in length-grouped batches (--data.bucket_by_length true): full-parameter, and LoRA r 16 on
      # q/k/v/o through the same recipe (the lora recipe reads prompt/response records, padded, only)
      S=$OUT/sft_packing
      if [ "${SIZE:-}" = tiny ]; then
        echo '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "vocab_size": 32000,
 "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false}' > "$SFT_MODEL"
      fi
      python3 benchmarks/make_sft_data.py "$D/imdb/train.jsonl.gz" "$S/chat_train.jsonl" --chat --n "${SFT_N[0]}" \
        --max_chars "${SFT_N[2]}"
      python3 benchmarks/make_sft_data.py "$D/imdb/test.jsonl.gz" "$S/chat_val.jsonl" --chat --n "${SFT_N[1]}" \
        --max_chars "${SFT_N[2]}"
      sb() { local name=$1; shift; z benchmark causal-lm --strategies "${STRATEGY:-zero2}" --predict false --out "$S/$name" \
        "${SFT[@]}" "$@" > "$S/$name.log" 2>&1; echo "$name rc=$?"; }
      FULL=(--optimizer.lr 3e-4)
      LORA_ON=(--model.lora.r 16 --model.lora.alpha 32 --optimizer.lr 1e-3)
      for row in ${ROWS:-full_packed full_padded full_grouped lora_packed lora_padded lora_grouped}; do
        case $row in
          full_*) ON=("${FULL[@]}") ;;
          lora_*) ON=("${LORA_ON[@]}") ;;
        esac
        case $row in
          *_packed) sb "$row" "${ON[@]}" --data.pack true ;;
          *_padded) sb "$row" "${ON[@]}" --data.pack false ;;
          *_grouped) sb "$row" "${ON[@]}" --data.pack false --data.bucket_by_length true ;;
        esac
      done
      python3 benchmarks/compare_rows.py --out "$S/sft_packing" \
        --title "Chat SFT, packed vs padded: $(basename "$SFT_MODEL" .json), seq $SFT_SEQ, $SFT_PRECISION, micro-batch $SFT_MICRO, one pass" \
        --zerotrain "full, packed=$S/full_packed/benchmark.json" \
        --zerotrain "full, padded=$S/full_padded/benchmark.json" \
        --zerotrain "full, padded, length-grouped=$S/full_grouped/benchmark.json" \
        --zerotrain "LoRA r16, packed=$S/lora_packed/benchmark.json" \
        --zerotrain "LoRA r16, padded=$S/lora_padded/benchmark.json" \
        --zerotrain "LoRA r16, padded, length-grouped=$S/lora_grouped/benchmark.json" | tail -n 16 ;;
    offload_large_model)  # full AdamW with the optimizer on the host (ZeRO-2 + CPU offload), one GPU.
      # SIZE=12b: 60 layers (12.31B parameters), micro-batch 32, pinned (needs ~260 GiB of host memory);
      # SIZE=host125: 32 layers (6.67B), micro-batch 16, unpinned, GPU capped at 79 GiB (fits a 125 GiB host)
      if [ "${SIZE:-12b}" = 12b ]; then
        z benchmark mlm --strategies zero2_offload --predict false --out "$OUT/offload_large_model/12b" "${BIG[@]}" \
          --model.num_layers 60 --trainer.micro_batch_size 32 | tail -n 3
      else
        z benchmark mlm --strategies zero2_offload --predict false --out "$OUT/offload_large_model/host125" "${BIG[@]}" \
          --model.num_layers 32 --trainer.micro_batch_size 16 --strategy.offload_pin_memory false \
          --trainer.gpu_memory_gib 79 | tail -n 3
      fi ;;
    offload_5b)  # MLM 24 layers x 4096 (5.06B), ZeRO-2 + CPU offload, micro-batch 96, memory predicted from a
      # probe (PROBE=file; without it the benchmark takes its own), then the run's export
      z benchmark mlm --strategies zero2_offload --out "$OUT/offload_5b" ${PROBE:+--probe "$PROBE"} "${BIG[@]}" \
        --model.num_layers 24 --trainer.micro_batch_size 96 --trainer.export true | tail -n 3 ;;
    offload_7b)  # Llama-shaped 6.74B (configs/llama_7b_config.json, random weights), full AdamW with the optimizer on the
      # host, activation checkpointing, micro-batch 48 x 2,048, one GPU (~130 GiB of host memory: the 4-GPU machines);
      # then the Hugging Face Trainer with DeepSpeed's ZeRO-3 + CPU offload JSON as a user writes it
      z benchmark causal-lm --strategies zero2_offload --predict false --out "$OUT/offload_7b/zerotrain" "${L7[@]}" \
        > "$OUT/offload_7b/zerotrain.log" 2>&1; echo "zerotrain rc=$?"
      python3 benchmarks/hf_trainer.py --recipe causal-lm --out "$OUT/offload_7b/hf_trainer_zero3_offload.json" --warmup 1 \
        --trainer_args '{"gradient_checkpointing": true}' -- "${L7[@]}" --trainer.max_steps 3 \
        --strategy.deepspeed_config benchmarks/ds_zero3_offload_auto.json > "$OUT/offload_7b/hf_trainer.log" 2>&1
      echo "hf_trainer rc=$?"
      python3 benchmarks/compare_rows.py --out "$OUT/offload_7b/offload_7b" \
        --title "Llama-shaped 6.74B, one GPU, full AdamW, optimizer on the host, micro-batch 48 x 2048" \
        --zerotrain "zerotrain ZeRO-2 + CPU optimizer offload=$OUT/offload_7b/zerotrain/benchmark.json" \
        --peer "HF Trainer + DeepSpeed ZeRO-3 + CPU offload JSON=$OUT/offload_7b/hf_trainer_zero3_offload.json" | tail -n 6 ;;
    offload_7b_host125)  # the same 6.74B on a one-GPU machine with a 125 GiB host: zerotrain's ZeRO-3 with the optimizer
      # on the host (the layout whose host states fit best), micro-batch MICRO (default 32), then the HF Trainer with
      # DeepSpeed's ZeRO-3 offload JSON as a user writes it (PEER_JSON; ds_zero3_offload_optimizer_auto.json keeps the
      # weights on the GPU as zerotrain does); host and GPU memory every 5 s. STATES=bf16: bf16 master weights and AdamW
      # states (zerotrain's row only; the peer runs without STATES). ACCUM=k: k micro-batches a step (the host's
      # optimizer step shared by k times the tokens); STEPS (default 6) steps, the first min(2, STEPS - 1) not timed, the
      # learning rate warmed up over 2 (1 when STEPS <= 2); LAYERS=n: the same model with n layers instead of 32; PINNED=false:
      # the host states in pageable memory (no power-of-two blocks). The peer's JSON sets its own pinning. RATIO=r: only the
      # share r of the optimizer on the host, the rest on the GPU (--strategy.offload_optimizer_ratio; not with NVME).
      # NVME=DIR: ZeRO-Infinity instead, the fp32 master weights, AdamW states and the 16-bit weights swapped to DIR
      # (zerotrain's zero3_nvme row; no peer), the megabytes under DIR in the memory timeline's fourth column.
      MODEL7=configs/llama_7b_config.json; STEPS7=${STEPS:-6}
      if [ -n "${LAYERS:-}" ]; then
        MODEL7=$OUT/offload_7b_host125/llama_${LAYERS}_layers_config.json
        sed "s/\"num_hidden_layers\": 32/\"num_hidden_layers\": $LAYERS/" configs/llama_7b_config.json > "$MODEL7"
        grep -q "\"num_hidden_layers\": $LAYERS," "$MODEL7" || { echo "LAYERS=$LAYERS: not written to $MODEL7"; exit 2; }
      fi
      L7H=("${L7[@]}" --model.config "$MODEL7" --trainer.micro_batch_size "${MICRO:-32}" --trainer.max_steps "$STEPS7"
           --trainer.warmup_steps_excluded $(( STEPS7 > 2 ? 2 : STEPS7 - 1 )) --scheduler.warmup_steps $(( STEPS7 > 2 ? 2 : 1 ))
           --strategy.gradient_accumulation_steps "${ACCUM:-1}" ${PINNED:+--strategy.offload_pin_memory "$PINNED"}
           ${STATES:+--precision.master_weights "$STATES" --precision.optimizer_states "$STATES"}
           ${NVME:+--strategy.nvme_path "$NVME"} ${RATIO:+--strategy.offload_optimizer_ratio "$RATIO"})
      ( while sleep 5; do echo "$SECONDS $(free -g | awk '/Mem:/{print $3}') $(nvidia-smi --query-gpu=memory.used \
          --format=csv,noheader,nounits | head -n 1) $(du -sm "${NVME:-/nonexistent}" 2>/dev/null | cut -f1)"
        done > "$OUT/offload_7b_host125/memory_timeline.txt" ) &
      SAMPLER=$!
      z benchmark causal-lm --strategies "$([ -n "${NVME:-}" ] && echo zero3_nvme || echo zero3_offload_optimizer)" \
        --predict false --out "$OUT/offload_7b_host125/zerotrain" "${L7H[@]}" > "$OUT/offload_7b_host125/zerotrain.log" 2>&1
      echo "zerotrain rc=$?"
      if [ -z "${STATES:-}${NVME:-}${RATIO:-}" ]; then
        python3 benchmarks/hf_trainer.py --recipe causal-lm --out "$OUT/offload_7b_host125/hf_trainer.json" --warmup 1 \
          --trainer_args '{"gradient_checkpointing": true}' -- "${L7H[@]}" --trainer.max_steps 4 \
          --strategy.deepspeed_config "${PEER_JSON:-benchmarks/ds_zero3_offload_auto.json}" \
          > "$OUT/offload_7b_host125/hf_trainer.log" 2>&1
        echo "hf_trainer rc=$?"
      fi
      kill $SAMPLER ;;
    state_precision)  # CPU: what bf16 master weights and AdamW states cost in loss, against fp32 ones, on a model small
      # enough for a CPU (4 layers x 256, a 4,096-token BPE of the Gutenberg text), ZeRO-2, bf16 compute, STEPS
      # (default 300) optimizer steps of 8 x 256 tokens, learning rate 1e-3 after a tenth of them, decayed linearly to 0; the same seed and
      # data order in every run, the validation loss on 25 held-out batches (200 rows) at the end. ROWS (default
      # "fp32 bf16"): fp32 (master weights and moments), bf16 (both), fp32_host and bf16_master_host (the optimizer on
      # the host as DeepSpeedCPUAdam, the only place DeepSpeed keeps fp32 moments beside bf16 master weights).
      # SEED (default 42) seeds the weights and the data order; runs of another seed are named ..._seedN
      S=$OUT/state_precision
      [ -d "$D/tok4k" ] || python3 benchmarks/make_tokenizer.py "$D/gutenberg/train.txt.xz" "$D/tok4k" --vocab 4096 \
        --max_lines 50000 > /dev/null
      printf '%s\n' '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,' \
        '"intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,' \
        '"vocab_size": 4096, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,' \
        '"bos_token_id": 1, "eos_token_id": 2}' > "$S/llama_small_config.json"
      SP=(--model.init random --model.config "$S/llama_small_config.json" --model.tokenizer "$D/tok4k"
          --data.train_path "$D/gutenberg/train.txt.xz" --data.val_path "$D/gutenberg/validation.txt.xz" --data.format text
          --data.seq_len 256 --data.max_train_lines 60000 --trainer.eval_max_batches 25 --data.cache_dir "$OUT/cache"
          --precision.dtype bf16 --strategy.zero_stage 2 --optimizer.lr 1e-3 --scheduler.name warmup_linear
          --scheduler.warmup_steps $(( ${STEPS:-300} / 10 )) --trainer.micro_batch_size 8 --trainer.max_steps "${STEPS:-300}"
          --trainer.log_every_steps 1 --trainer.eval_every_steps 0 --trainer.export false --checkpoint.save_final false
          --logging.progress_bar false --trainer.output_dir "$S/runs" --trainer.seed "${SEED:-42}")
      SUFFIX=$([ "${SEED:-42}" = 42 ] || echo "_seed$SEED")
      CURVES=()
      for row in ${ROWS:-fp32 bf16}; do
        case $row in
          fp32) extra=(); label="fp32 master weights and states";;
          bf16) extra=(--precision.master_weights bf16 --precision.optimizer_states bf16)
                label="bf16 master weights and states";;
          fp32_host) extra=(--strategy.offload_optimizer cpu); label="fp32 master weights and states, CPU Adam";;
          bf16_master_host) extra=(--strategy.offload_optimizer cpu --precision.master_weights bf16)
                label="bf16 master weights, fp32 states, CPU Adam";;
          *) echo "state_precision: unknown row $row (fp32, bf16, fp32_host, bf16_master_host)"; continue;;
        esac
        z fit causal-lm "${SP[@]}" "${extra[@]}" --trainer.run_name "${row}_states$SUFFIX" \
          > "$S/${row}_states$SUFFIX.log" 2>&1; echo "$row states rc=$?"
        CURVES+=(--run "$label${SUFFIX:+ (seed ${SEED})}=$S/runs/${row}_states$SUFFIX")
      done
      [ ${#CURVES[@]} -gt 0 ] && python3 benchmarks/loss_curves.py --out "$S/state_precision$SUFFIX" --last 50 \
        --title "4 x 256 Llama, ZeRO-2, bf16 compute: master weights and AdamW states in fp32 and bf16" "${CURVES[@]}" ;;
    engines)  # DeepSpeed's ZeRO-1/2/3 against PyTorch's FSDP2 (with and without resharding after forward): zerotrain plan
      # measures every one at the configured micro-batch beside its own pick, for BERT-base MLM and the 1.1B causal LM on
      # one GPU, again on two GPUs where there are two (files in $OUT/planner/, tables by benchmarks/plan_tables.py).
      # MODELS (default "bert_base llama_1b") picks the workloads
      mkdir -p "$OUT/planner"
      ENGINES=zero1,zero2,zero3,fsdp2,fsdp2_no_reshard
      GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      for m in ${MODELS:-bert_base llama_1b}; do
        case $m in
          bert_base) W=(mlm "${BERT[@]}" --trial_steps 10);;
          llama_1b) W=(causal-lm "${LLAMA[@]}" --trainer.warmup_steps_excluded 5 --trial_steps 10);;
          *) echo "engines: unknown model $m (bert_base, llama_1b)"; continue;;
        esac
        plan "engines_${m}_1gpu" "${W[@]}" --strategies "$ENGINES"
        [ "$GPUS" -ge 2 ] && plan "engines_${m}_2gpu" "${W[@]}" --launch.nproc_per_node 2 --strategies "$ENGINES"
      done
      python3 benchmarks/plan_tables.py "$OUT"/planner/engines_*/plan.json --plot "$OUT/planner/engines.png" ;;
    planner)  # zerotrain plan on each workload, its pick against every strategy measured (one GPU; bert_base_2gpu needs 2)
      plan imdb_b imdb --config configs/imdb_b.yaml --data.path "$D/imdb" --data.tokenizer "$TOK" --trial_steps 20 \
        --strategies ddp,zero0,zero1,zero2,zero3
      plan bert_base_1gpu mlm "${BERT[@]}" --trial_steps 10 --strategies ddp,zero0,zero1,zero2,zero3
      plan hello_mlm mlm "${BERT[@]}" --model.num_layers 6 --model.num_heads 8 --model.h_dim 256 --model.ff_dim 512 \
        --trainer.micro_batch_size 8 --trial_steps 20 --strategies ddp,zero0,zero1,zero2,zero3
      python3 benchmarks/make_sft_data.py "$D/imdb/train.jsonl.gz" "$OUT/sft.jsonl" --n 2000
      plan lora_1b lora "${LORA[@]}" --strategies ddp,zero0,zero2_offload --trials 2 --trial_steps 5
      plan mlm_0b9_12gib mlm "${BERT[@]}" --model.num_layers 16 --model.num_heads 16 --model.h_dim 2048 \
        --model.ff_dim 8192 --trainer.micro_batch_size 8 --trainer.gpu_memory_gib 12 --trial_steps 3 \
        --strategies ddp,zero2,zero1_offload,zero2_offload,zero3_offload
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        plan bert_base_2gpu mlm "${BERT[@]}" --trial_steps 10 --launch.nproc_per_node 2 --strategies ddp,zero1,zero2
      fi
      python3 benchmarks/plan_tables.py "$OUT"/planner/*/plan.json ;;
    kill_test)  # CPU: SIGKILL at random moments, resume, compare with an uninterrupted run (toy recipe)
      python3 benchmarks/kill_test.py --kills "${KILLS:-10}" --suites all --out "$OUT/kill_test/kill_test.json" ;;
    restart_test)  # CPU: --launch.max_restarts 1, one of 2 workers killed per run, compared with an uninterrupted run
      python3 benchmarks/kill_test.py --restarts --kills "${KILLS:-20}" --configs ddp --jobs "${JOBS:-3}" --max-steps 40 \
        --out "$OUT/restart_test/restart_test.json" ;;
    gpu_tests)
      z doctor > "$OUT/gpu_tests/doctor.txt" 2>&1
      python3 -m pytest -m gpu -q > "$OUT/gpu_tests/pytest_gpu.txt" 2>&1; echo "pytest -m gpu: rc=$?" ;;
    *) echo "unknown part $part (see the list at the top of benchmarks/run.sh)" >&2; exit 2 ;;
  esac
done
