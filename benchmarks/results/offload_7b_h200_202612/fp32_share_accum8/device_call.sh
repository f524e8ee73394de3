#!/usr/bin/env bash
# The command of this run (LIMIT=340 bash device_call.sh on one H200, from the repository root): 6.74B with fp32 states,
# 35% of the optimizer on the GPU, micro 16 x 8 accumulation, 2 steps (the second timed), then the export; then the
# 12.0B bf16-states row, which its 123 s left did not allow. Its first tar names a folder that does not exist, so
# machine.txt and memory_timeline.txt did not come back.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 || exit
for f in .deb/*.deb; do dpkg -x $f /; done; ldconfig
export ZEROTRAIN_COMMIT=$(cat .probe/commit)
START=$SECONDS
R=$OUT/fp32_share_7b; mkdir -p $R
( nvidia-smi; free -g; nproc; df -h /tmp ) > $R/machine.txt 2>&1
( while sleep 5; do echo "$SECONDS $(free -g | awk '/Mem:/{print $3}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)"; cp /tmp/runs/fp32_share/metrics.jsonl $R/ 2>/dev/null; done > $R/memory_timeline.txt ) &
SAMPLER=$!
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s TERM $(( ${LIMIT:-560} - 50 )) python3 -m zerotrain fit causal-lm --model.init random \
  --model.config configs/llama_7b_config.json --model.tokenizer .data/tok32k --data.train_path .data/gutenberg/train.txt.xz \
  --data.format text --data.seq_len 2048 --data.max_train_lines 30000 --data.cache_dir /tmp/cache --precision.dtype bf16 \
  --optimizer.lr 3e-4 --scheduler.warmup_steps 1 --trainer.micro_batch_size 16 --activation_checkpointing.enabled true \
  --trainer.max_steps 2 --trainer.warmup_steps_excluded 1 --trainer.log_every_steps 1 --trainer.evaluate false \
  --trainer.export true --checkpoint.save_final false --checkpoint.every_steps 0 --logging.progress_bar false \
  --strategy.zero_stage 3 --strategy.offload_optimizer cpu --strategy.offload_optimizer_ratio 0.65 \
  --strategy.gradient_accumulation_steps 8 --trainer.output_dir /tmp/runs --trainer.run_name fp32_share \
  > $R/fit.log 2>&1
echo "rc=$? at $((SECONDS-START)) s" >> $R/fit.log
kill $SAMPLER
for f in metrics.jsonl summary.json env.json hparams.json ds_config.json; do cp /tmp/runs/fp32_share/$f $R/ 2>/dev/null; done
ls -la /tmp/runs/fp32_share/model > $R/export_files.txt 2>&1
rm -rf /tmp/runs/fp32_share/model
(cd $OUT && tar czf fp32_share.tgz fp32_share && rm -rf fp32_share)
LEFT=$(( ${LIMIT:-560} - (SECONDS-START) ))
echo "12B row: $LEFT s left" > $OUT/left.txt
if [ $LEFT -gt 150 ]; then
  OUT=$OUT/bf16_58 LAYERS=58 MICRO=24 STATES=bf16 PINNED=false STEPS=3 timeout -s TERM $LEFT bash benchmarks/run.sh offload_7b_host125 > $OUT/bf16_58.log 2>&1
  echo "rc=$?" >> $OUT/bf16_58.log
  find $OUT/bf16_58 -name "*.jsonl" -o -name "*.json" -o -name "*.md" | head -30 >> $OUT/bf16_58.log
fi
cd $OUT && tar czf bf16_58.tgz --exclude=cache bf16_58 bf16_58.log left.txt 2>/dev/null; rm -rf bf16_58
