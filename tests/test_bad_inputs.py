"""Every bad input in docs/BAD_INPUTS.md gets exactly the line the table shows, and the exit status it shows.

The doc is the expected output; this module holds the inputs. They cannot drift apart:

* ``test_doc_lists_every_case`` fails when a case has no row or a row no case (same ids, same order);
* ``test_bad_input[ID]`` runs case ID in-process (``zerotrain.cli.main``) and compares its stderr, with
  the temporary folder written as ``{tmp}``, with the row's message, character for character;
* ``python tests/test_bad_inputs.py`` rewrites the table from what the commands print now (run it after
  changing a message on purpose, and read the diff).

A few cases also run through ``python -m zerotrain`` with 1 and 2 processes (slow) to show that a job
of two ranks ends with the same single line as one process.
"""

from __future__ import annotations

import json
import pickle
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, child_env, make_tokenizer, zerotrain_cmd

DOC = REPO / "docs" / "BAD_INPUTS.md"

FIT = ("--trainer.max_steps 1 --trainer.output_dir {tmp}/runs --trainer.num_workers 0 --trainer.device cpu "
       "--logging.progress_bar false --logging.tensorboard false")
MLM = ("--data.cache_dir {tmp}/cache --model.num_layers 1 --model.h_dim 16 --model.num_heads 2 --model.ff_dim 16 "
       "--model.max_seq_length 8")
IMDB = ("--data.cache_dir {tmp}/cache --model.embed_dim 16 --model.hidden_dim 16 --model.num_heads 2 "
        "--model.num_layers 1 --model.max_len 16 --data.tokenizer {tok}")
LORA = "--model.init random --model.config {tmp}/llama.json --model.tokenizer {tok} --data.max_length 16"
CLM = "--model.tokenizer {tok} --data.seq_len 16 --data.cache_dir {tmp}/cache"
CLS = "--model.init random --model.config {tmp}/bert.json --model.tokenizer {tok} --data.max_length 16"
BASES = {"$FIT": FIT, "$MLM": MLM, "$IMDB": IMDB, "$LORA": LORA, "$CLM": CLM, "$CLS": CLS}


@dataclass(frozen=True)
class Case:
    id: str
    where: str
    """What kind of input: flag, yaml, ds-json, data, tokenizer, output, checkpoint, launch, command."""
    command: str
    """After ``zerotrain``; ``$FIT`` etc. expand to BASES, ``{tmp}``/``{tok}`` to the fixture's folders, ``{port}`` to
    a free port; leading ``NAME=value`` words are set in the environment for the command only."""
    code: int = 2
    shows: str = ""
    """Only the stderr lines that start with this are compared, and they must be exactly one: for an input zerotrain
    repairs (``code`` 0, the run goes on and prints more), the warning that says what was repaired; for one refused
    after the run has printed its progress lines, the error line."""


CASES = [
    # ---- flags ----
    Case("unknown-flag", "flag", "fit toy $FIT --no.such.flag 1"),
    Case("flag-prefix", "flag", "fit toy $FIT --trainer.max_step 5"),
    Case("flag-wrong-type", "flag", "fit toy $FIT --trainer.max_steps five"),
    Case("flag-bad-choice", "flag", "fit toy $FIT --strategy.backend fsdp"),
    Case("optimizer-unknown", "flag", "fit toy $FIT --optimizer.name sgdd"),
    Case("optimizer-class-not-found", "flag", "fit toy $FIT --optimizer.name no_such_package.optim:Fast"),
    Case("optimizer-not-an-optimizer", "flag", "fit toy $FIT --optimizer.name collections.OrderedDict"),
    Case("flag-bad-precision", "flag", "fit toy $FIT --precision.dtype fp8"),
    Case("old-precision-flag", "flag", "fit toy $FIT --strategy.precision bf16"),
    Case("old-compile-flag", "flag", "fit toy $FIT --strategy.compile true"),
    Case("no-length", "flag", "fit toy --trainer.output_dir {tmp}/runs"),
    Case("max-steps-zero", "flag", "fit toy $FIT --trainer.max_steps 0"),
    Case("epochs-zero", "flag", "fit toy $FIT --trainer.epochs 0"),
    Case("micro-batch-zero", "flag", "fit toy $FIT --trainer.micro_batch_size 0"),
    Case("gpu-memory-zero", "flag", "fit toy $FIT --trainer.gpu_memory_gib 0"),
    Case("log-every-zero", "flag", "fit toy $FIT --trainer.log_every_steps 0"),
    Case("eval-every-negative", "flag", "fit toy $FIT --trainer.eval_every_steps -1"),
    Case("num-workers-negative", "flag", "fit toy $FIT --trainer.num_workers -1"),
    Case("eval-max-batches-zero", "flag", "fit toy $FIT --trainer.eval_max_batches 0"),
    Case("warmup-excluded-negative", "flag", "fit toy $FIT --trainer.warmup_steps_excluded -1"),
    Case("seed-huge", "flag", "fit toy $FIT --trainer.seed 99999999999999999999"),
    Case("seed-negative", "flag", "fit toy $FIT --trainer.seed -1"),
    Case("lr-zero", "flag", "fit toy $FIT --optimizer.lr 0"),
    Case("eps-negative", "flag", "fit toy $FIT --optimizer.eps -1"),
    Case("betas-out-of-range", "flag", "fit toy $FIT --optimizer.betas [0.9,1.5]"),
    Case("betas-one-value", "flag", "fit toy $FIT --optimizer.betas [0.9]"),
    Case("weight-decay-negative", "flag", "fit toy $FIT --optimizer.weight_decay -0.1"),
    Case("warmup-negative", "flag", "fit toy $FIT --scheduler.warmup_steps -1"),
    Case("warmup-longer-than-run", "flag", "fit toy $FIT --scheduler.warmup_steps 100"),
    Case("warmup-longer-than-epochs", "flag",
         "fit toy --trainer.epochs 1 --trainer.output_dir {tmp}/runs --trainer.num_workers 0 --trainer.device cpu "
         "--logging.progress_bar false --logging.tensorboard false --scheduler.warmup_steps 1000"),
    Case("min-lr-ratio", "flag", "fit toy $FIT --scheduler.min_lr_ratio 2"),
    Case("gamma-zero", "flag", "fit toy $FIT --scheduler.name step --scheduler.gamma 0"),
    Case("step-size-zero", "flag", "fit toy $FIT --scheduler.name step --scheduler.step_size 0"),
    Case("zero-stage-4", "flag", "fit toy $FIT --strategy.zero_stage 4"),
    Case("offload-param-stage-2", "flag", "fit toy $FIT --strategy.offload_param cpu --strategy.zero_stage 2"),
    Case("offload-optimizer-stage-0", "flag", "fit toy $FIT --strategy.offload_optimizer cpu"),
    Case("nvme-without-path", "flag", "fit toy $FIT --strategy.zero_stage 3 --strategy.offload_optimizer nvme"),
    Case("offload-ratio-above-1", "flag", "fit toy $FIT --strategy.offload_optimizer_ratio 1.5"),
    Case("offload-ratio-stage-2", "flag",
         "fit toy $FIT --strategy.zero_stage 2 --strategy.offload_optimizer cpu --strategy.offload_optimizer_ratio 0.5"),
    Case("offload-ratio-with-adam", "flag", "fit toy $FIT --strategy.zero_stage 3 --strategy.offload_optimizer cpu "
         "--strategy.offload_optimizer_ratio 0.5 --optimizer.name adam"),
    Case("bf16-states-without-bf16-master", "flag", "fit toy $FIT --strategy.zero_stage 2 --precision.dtype bf16 "
         "--precision.optimizer_states bf16"),
    Case("bf16-master-at-stage-0", "flag", "fit toy $FIT --precision.dtype bf16 --precision.master_weights bf16 "
         "--precision.optimizer_states bf16"),
    Case("bf16-master-fp32-states-on-gpu", "flag", "fit toy $FIT --strategy.zero_stage 2 --precision.dtype bf16 "
         "--precision.master_weights bf16"),
    Case("bf16-master-on-nvme", "flag", "fit toy $FIT --strategy.zero_stage 3 --strategy.offload_optimizer nvme "
         "--strategy.nvme_path {tmp}/swap --precision.dtype bf16 --precision.master_weights bf16 "
         "--precision.optimizer_states bf16"),
    Case("ddp-with-zero", "flag", "fit toy $FIT --strategy.backend ddp --strategy.zero_stage 2"),
    Case("ddp-with-json", "flag", "fit toy $FIT --strategy.backend ddp --strategy.deepspeed_config {tmp}/ok.json"),
    Case("fsdp2-with-zero", "flag", "fit toy $FIT --strategy.backend fsdp2 --strategy.zero_stage 3"),
    Case("fsdp2-fp16", "flag", "fit toy $FIT --strategy.backend fsdp2 --precision.dtype fp16"),
    Case("accumulation-zero", "flag", "fit toy $FIT --strategy.gradient_accumulation_steps 0"),
    Case("clipping-negative", "flag", "fit toy $FIT --strategy.gradient_clipping -1"),
    Case("reduce-bucket-zero", "flag", "fit toy $FIT --strategy.reduce_bucket_size 0"),
    Case("allgather-bucket-zero", "flag", "fit toy $FIT --strategy.allgather_bucket_size 0"),
    Case("fp16-on-cpu", "flag", "fit toy $FIT --precision.dtype fp16"),
    Case("every-steps-negative", "flag", "fit toy $FIT --checkpoint.every_steps -1"),
    Case("keep-last-zero", "flag", "fit toy $FIT --checkpoint.keep_last 0"),
    Case("mlm-heads-do-not-divide", "flag", "fit mlm $FIT $MLM --model.num_heads 3 --data.tokenizer {tok}"),
    Case("mlm-mask-prob", "flag", "fit mlm $FIT $MLM --data.mask_prob 1.5 --data.tokenizer {tok}"),
    Case("mlm-mask-prob-zero", "flag", "fit mlm $FIT $MLM --data.mask_prob 0 --data.tokenizer {tok}"),
    Case("lora-rank-zero", "flag", "fit lora $FIT $LORA --data.train_path {tmp}/lora.jsonl --model.lora_r 0"),
    Case("lora-template", "flag", "fit lora $FIT $LORA --data.train_path {tmp}/lora.jsonl --data.template {input}"),
    Case("unknown-recipe", "command", "fit nosuch $FIT"),
    Case("task-module-missing", "command", "fit no_such_package.tasks:MyTask $FIT"),
    Case("task-attribute-missing", "command", "fit zerotrain.tasks.toy:MyTask $FIT"),
    Case("task-not-a-task", "command", "fit zerotrain.tasks.toy:ToyConfig $FIT"),
    Case("unknown-subcommand", "command", "nosuch"),
    Case("estimate-negative-memory", "command", "estimate toy --gpu_memory_gib -3"),
    Case("plan-several-nodes", "command", "plan toy $FIT --launch.nnodes 2 --out {tmp}/plan"),
    Case("plan-user-ds-json", "command", "plan toy $FIT --strategy.deepspeed_config {tmp}/x.json --out {tmp}/plan"),
    Case("plan-zero-trials", "command", "plan toy $FIT --trials 0 --out {tmp}/plan"),
    Case("plan-unknown-strategy", "command", "plan toy $FIT --strategies zero9 --out {tmp}/plan"),
    Case("plan-strategy-twice", "command", "plan toy $FIT --strategies zero2,zero2 --out {tmp}/plan"),
    Case("plan-strategies-empty", "command", "plan toy $FIT --strategies '' --out {tmp}/plan"),
    Case("benchmark-nproc-zero", "command", "benchmark toy --strategies ddp --nproc 0 --out {tmp}/bench $FIT"),
    Case("predict-no-texts", "command", "predict {tmp}/runs/toyrun"),
    Case("predict-missing-run", "command", "predict {tmp}/nope hello"),
    Case("predict-run-is-a-file", "command", "predict {tmp}/train.txt hello"),
    Case("predict-toy", "command", "predict {tmp}/runs/toyrun hello"),
    Case("plan-out-is-file", "command", "plan toy $FIT --out {tmp}/train.txt"),
    Case("benchmark-out-under-a-file", "command", "benchmark toy --out {tmp}/train.txt/bench $FIT"),
    Case("predict-file-binary", "command", "predict {tmp}/runs/toyrun --file {tmp}/binary.yaml"),
    # ---- launch ----
    Case("nproc-zero", "launch", "fit toy $FIT --launch.nproc_per_node 0"),
    Case("nnodes-zero", "launch", "fit toy $FIT --launch.nnodes 0"),
    Case("node-rank-out-of-range", "launch", "fit toy $FIT --launch.nnodes 2 --launch.node_rank 2"),
    Case("endpoint-without-port", "launch", "fit toy $FIT --launch.rdzv_endpoint localhost"),
    Case("timeout-zero", "launch", "fit toy $FIT --launch.timeout_minutes 0"),
    Case("timeout-too-short", "launch", "fit toy $FIT --launch.timeout_minutes 0.01"),
    Case("rdzv-timeout-zero", "launch", "fit toy $FIT --launch.rdzv_timeout_minutes 0"),
    Case("max-restarts-negative", "launch", "fit toy $FIT --launch.max_restarts -1"),
    Case("nccl-on-cpu", "launch", "fit toy $FIT --launch.comm_backend nccl"),
    Case("endpoint-port-out-of-range", "launch", "fit toy $FIT --launch.rdzv_endpoint localhost:70000"),
    Case("env-rank-without-world-size", "launch", "RANK=0 fit toy $FIT"),
    Case("env-world-size-not-a-number", "launch", "RANK=0 WORLD_SIZE=two fit toy $FIT"),
    Case("env-rank-outside-world", "launch", "RANK=2 WORLD_SIZE=2 fit toy $FIT"),
    Case("env-master-port-out-of-range", "launch",
         "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=70000 fit toy $FIT"),
    Case("env-slurm-ntasks-not-a-number", "launch", "SLURM_PROCID=0 SLURM_NTASKS=2x fit toy $FIT"),
    Case("env-torch-extensions-dir-under-a-file", "launch", "TORCH_EXTENSIONS_DIR={tmp}/train.txt/ext fit toy $FIT"),
    Case("env-home-unwritable", "launch", "HOME={tmp}/train.txt/home fit toy $FIT"),
    Case("env-home-unwritable-data-cache", "launch", "HOME={tmp}/train.txt/home fit mlm $FIT --strategy.backend ddp "
         "--model.num_layers 1 --model.h_dim 16 --model.num_heads 2 --model.ff_dim 16 --model.max_seq_length 8 "
         "--data.train_path {tmp}/train.txt --data.tokenizer {tok}"),
    Case("env-world-size-no-peer", "launch",
         "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port} fit toy $FIT --launch.timeout_minutes 0.05"),
    Case("env-slurm-ntasks-no-peer", "launch",
         "SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_NNODES=1 fit toy $FIT --launch.rdzv_endpoint 127.0.0.1:{port} "
         "--launch.timeout_minutes 0.05"),
    # ---- YAML ----
    Case("yaml-missing", "yaml", "fit toy $FIT --config {tmp}/missing.yaml"),
    Case("yaml-unknown-key", "yaml", "fit toy $FIT --config {tmp}/unknown_key.yaml"),
    Case("yaml-syntax", "yaml", "fit toy $FIT --config {tmp}/broken.yaml"),
    Case("yaml-wrong-type", "yaml", "fit toy $FIT --config {tmp}/wrong_type.yaml"),
    Case("yaml-old-layout", "yaml", "fit toy $FIT --config {tmp}/old_layout.yaml"),
    Case("yaml-section-scalar", "yaml", "fit toy $FIT --config {tmp}/section_scalar.yaml"),
    Case("yaml-section-null", "yaml", "fit toy $FIT --config {tmp}/section_null.yaml"),
    Case("yaml-not-a-mapping", "yaml", "fit toy $FIT --config {tmp}/list.yaml"),
    Case("yaml-empty", "yaml", "fit toy $FIT --config {tmp}/empty.yaml"),
    Case("yaml-binary", "yaml", "fit toy $FIT --config {tmp}/binary.yaml"),
    Case("yaml-alias-bomb", "yaml", "fit toy $FIT --config {tmp}/bomb.yaml"),
    # ---- DeepSpeed JSON ----
    Case("json-missing", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/missing.json"),
    Case("json-syntax", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/broken.json"),
    Case("json-not-object", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/list.json"),
    Case("json-misspelt-block", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/misspelt.json"),
    Case("json-misspelt-zero-key", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/zero_key.json"),
    Case("json-fp16-and-bf16", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/fp16_bf16.json"),
    Case("json-fp16-on-cpu", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/fp16.json"),
    Case("json-batch-rule", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/batch.json"),
    Case("json-activation-checkpointing", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/ac.json"),
    Case("json-unknown-optimizer", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/optimizer.json"),
    Case("json-offload-param-stage-2", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/offload.json"),
    Case("json-stage-5", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/stage5.json"),
    Case("json-auto-unresolvable", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/auto.json"),
    Case("json-block-not-object", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_block_number.json"),
    Case("json-number-not-list", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_micro_list.json"),
    Case("json-number-not-text", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_clipping_text.json"),
    Case("json-bool-not-text", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_enabled_yes.json"),
    Case("json-bool-not-number", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_enabled_one.json"),
    Case("json-bucket-text", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_bucket_text.json"),
    Case("json-pin-memory-text", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_pin_maybe.json"),
    Case("json-scalar-not-object", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_print_object.json"),
    Case("json-stage-bool", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/t_stage_true.json"),
    Case("json-accumulation-zero", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/accum_zero.json"),
    Case("json-offload-gpu", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/offload_gpu.json"),
    Case("json-bucket-negative", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/bucket_negative.json"),
    Case("json-unknown-scheduler", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/scheduler_unknown.json"),
    Case("json-comm-fp8", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/comm_fp8.json"),
    Case("json-block-misplaced", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/zenflow_top.json"),
    Case("json-refused-while-building", "ds-json",  # after the model's build line: DeepSpeed checks it with the model
         "fit toy $FIT --strategy.deepspeed_config {tmp}/zenflow_interval.json", shows="zerotrain fit: error: "),
    Case("json-super-offload", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/super_offload.json"),
    Case("json-ratio-stage-2", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/ratio_stage2.json"),
    Case("json-bf16-master-on-nvme", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/bf16_master_nvme.json"),
    Case("json-yaml-body", "ds-json", "fit toy $FIT --strategy.deepspeed_config {tmp}/yaml_body.json"),
    Case("json-flag-conflict-lr", "ds-json", "fit toy $FIT --optimizer.lr 0.5 --strategy.deepspeed_config {tmp}/lr.json"),
    Case("json-flag-conflict-micro", "ds-json",
         "fit toy $FIT --trainer.micro_batch_size 4 --strategy.deepspeed_config {tmp}/micro2.json"),
    Case("json-flag-conflict-stage", "ds-json", "fit toy $FIT --strategy.zero_stage 2 --strategy.deepspeed_config {tmp}/ok.json"),
    Case("json-flag-left-to-default", "ds-json",
         "fit toy $FIT --strategy.gradient_clipping 0.5 --strategy.deepspeed_config {tmp}/ok.json"),
    # ---- data ----
    Case("mlm-missing-file", "data", "fit mlm $FIT $MLM --data.train_path {tmp}/nope.txt --data.tokenizer {tok}"),
    Case("mlm-empty-file", "data", "fit mlm $FIT $MLM --data.train_path {tmp}/empty.txt --data.tokenizer {tok}"),
    Case("mlm-folder-not-file", "data", "fit mlm $FIT $MLM --data.train_path {tmp}/notes --data.tokenizer {tok}"),
    Case("mlm-csv-missing-field", "data",
         "fit mlm $FIT $MLM --data.train_path {tmp}/mlm_nofield.csv --data.tokenizer {tok}"),
    Case("imdb-missing-folder", "data", "fit imdb $FIT $IMDB --data.path {tmp}/nope"),
    Case("imdb-gz-not-gzip", "data", "fit imdb $FIT $IMDB --data.path {tmp}/imdb_notgz"),
    Case("imdb-binary-garbage", "data", "fit imdb $FIT $IMDB --data.path {tmp}/imdb_garbage"),
    Case("imdb-one-class", "data", "fit imdb $FIT $IMDB --data.path {tmp}/imdb_oneclass"),
    Case("imdb-hub-offline", "data", "fit imdb $FIT $IMDB --data.path someone/some-dataset"),
    Case("lora-no-train-path", "data", "fit lora $FIT $LORA"),
    Case("lora-missing-field", "data", "fit lora $FIT $LORA --data.train_path {tmp}/lora_nofield.jsonl"),
    Case("lora-bad-json-line", "data", "fit lora $FIT $LORA --data.train_path {tmp}/lora_broken.jsonl"),
    Case("causal-lm-model-hub-offline", "data",
         "fit causal-lm $FIT $CLM --model.name_or_path someone/some-model --data.train_path {tmp}/train.txt "
         "--trainer.micro_batch_size 1"),
    Case("causal-lm-no-chat-template", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/chat.jsonl"),
    Case("causal-lm-chat-no-assistant", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/chat_noanswer.jsonl --data.format chat"),
    Case("causal-lm-chat-template-fails", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/chat.jsonl --data.chat_template '{{ 1/0 }}'"),
    Case("causal-lm-chat-template-syntax", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/chat.jsonl --data.chat_template '{% for m in messages %}{{ m.content'"),
    Case("causal-lm-streaming-saved-dataset", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/saved_text --data.streaming true"),
    Case("causal-lm-streaming-bad-json-line", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/lora_broken.jsonl --data.streaming true --data.format sft "
         "--data.input_field input --data.target_field target"),
    Case("causal-lm-cache-dir-is-file", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/train.txt --data.cache_dir {tmp}/train.txt"),
    Case("tokenization-cache-cut-short", "data", "fit mlm $FIT --strategy.backend ddp --model.num_layers 1 "
         "--model.h_dim 16 --model.num_heads 2 --model.ff_dim 16 --model.max_seq_length 8 --data.train_path "
         "{tmp}/cut/train.txt --data.tokenizer {tok} --data.cache_dir {tmp}/cut/cache", code=0,
         shows="[zerotrain] the tokenization cache"),
    Case("mlm-cache-dir-is-file", "data",
         "fit mlm $FIT $MLM --data.train_path {tmp}/train.txt --data.tokenizer {tok} --data.cache_dir {tmp}/train.txt"),
    Case("imdb-cache-dir-under-a-file", "data", "fit imdb $FIT $IMDB --data.path {tmp}/imdb_ok "
         "--data.cache_dir {tmp}/train.txt/cache"),
    Case("classify-cache-dir-is-file", "data",
         "fit classify $FIT $CLS --data.train_path {tmp}/cls.jsonl --data.cache_dir {tmp}/train.txt"),
    Case("causal-lm-csv-missing-field", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/sft_nofield.csv --data.format sft"),
    Case("causal-lm-parquet-missing-field", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/docs.parquet --data.text_field body"),
    Case("causal-lm-mixed-formats", "data",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json "
         "--data.train_path {tmp}/mixed"),
    Case("classify-missing-label", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_nolabel.jsonl"),
    Case("classify-bad-label", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_badlabel.jsonl"),
    Case("classify-one-class", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_oneclass.jsonl"),
    Case("classify-val-label-unknown", "data",
         "fit classify $FIT $CLS --data.train_path {tmp}/cls.jsonl --data.val_path {tmp}/cls_other.jsonl"),
    Case("classify-empty-file", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_empty.jsonl"),
    Case("classify-csv-missing-label", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_nolabel.csv"),
    Case("classify-csv-bad-label", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_badlabel.csv"),
    Case("classify-csv-header-only", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_header.csv"),
    Case("classify-line-not-object", "data", "fit classify $FIT $CLS --data.train_path {tmp}/cls_list.jsonl"),
    Case("classify-text-file", "data", "fit classify $FIT $CLS --data.train_path {tmp}/train.txt"),
    Case("too-few-examples", "data", "fit toy $FIT --data.num_examples 4"),
    # ---- tokenizer ----
    Case("tokenizer-missing-folder", "tokenizer",
         "fit mlm $FIT $MLM --data.train_path {tmp}/train.txt --data.tokenizer {tmp}/no_tokenizer"),
    Case("tokenizer-config-only", "tokenizer",
         "fit mlm $FIT $MLM --data.train_path {tmp}/train.txt --data.tokenizer {tmp}/cfgonly"),
    Case("tokenizer-config-only-imdb", "tokenizer",
         "fit imdb $FIT $IMDB --data.path {tmp}/imdb_ok --data.tokenizer {tmp}/cfgonly"),
    Case("tokenizer-hub-offline", "tokenizer",
         "fit mlm $FIT $MLM --data.train_path {tmp}/train.txt --data.tokenizer someone/no-such-tokenizer"),
    Case("tokenizer-no-pad-classify", "tokenizer",
         "fit classify $FIT $CLS --model.tokenizer {tmp}/nopad --data.train_path {tmp}/cls.jsonl"),
    Case("tokenizer-no-pad-imdb", "tokenizer", "fit imdb $FIT $IMDB --data.path {tmp}/imdb_ok --data.tokenizer {tmp}/nopad"),
    Case("tokenizer-no-pad-causal-lm", "tokenizer",
         "fit causal-lm $FIT $CLM --model.init random --model.config {tmp}/llama.json --model.tokenizer {tmp}/nopad "
         "--data.train_path {tmp}/train.txt"),
    # ---- output folder ----
    Case("output-under-a-file", "output", "fit toy $FIT --trainer.output_dir {tmp}/train.txt/runs"),
    Case("export-out-not-empty", "output", "export {tmp}/runs/toyrun --out {tmp}/imdb_oneclass"),
    # ---- checkpoints ----
    Case("resume-auto-without-name", "checkpoint", "fit toy $FIT --checkpoint.resume auto"),
    Case("resume-missing", "checkpoint", "fit toy $FIT --checkpoint.resume {tmp}/nope"),
    Case("resume-no-checkpoint", "checkpoint", "fit toy $FIT --checkpoint.resume {tmp}/imdb_oneclass"),
    Case("resume-other-recipe", "checkpoint",
         "fit mlm $FIT $MLM --data.train_path {tmp}/train.txt --data.tokenizer {tok} "
         "--checkpoint.resume {tmp}/runs/toyrun"),
    Case("resume-other-size", "checkpoint",
         "fit toy $FIT --trainer.run_name toyrun --checkpoint.resume auto --model.width 16"),
    Case("resume-other-data", "checkpoint",
         "fit toy $FIT --trainer.run_name toyrun --checkpoint.resume auto --data.dim 4 --data.num_examples 64"),
    Case("resume-other-lr", "checkpoint", "fit toy $FIT --trainer.run_name toyrun --checkpoint.resume auto --optimizer.lr 0.5"),
    Case("export-missing-run", "checkpoint", "export {tmp}/nope"),
    Case("export-no-checkpoint", "checkpoint", "export {tmp}/nockpt"),
    Case("export-missing-step", "checkpoint", "export {tmp}/runs/toyrun --step 7"),
    Case("export-hf-not-mlm", "checkpoint", "export {tmp}/runs/toyrun --format hf"),
    # ---- files and folders from elsewhere ----
    Case("run-name-outside", "flag", "fit toy $FIT --trainer.run_name ../../x"),
    Case("run-name-absolute", "flag", "fit toy $FIT --trainer.run_name {tmp}/x"),
    Case("run-folder-link-out", "output", "fit toy $FIT --trainer.run_name linked"),
    Case("resume-crafted-pickle", "checkpoint", "fit toy $FIT --trainer.run_name crafted --checkpoint.resume auto"),
    Case("export-crafted-pickle", "checkpoint", "export {tmp}/runs/crafted"),
    Case("export-damaged", "checkpoint", "export {tmp}/runs/flipped"),
    Case("export-marker-without-files", "checkpoint", "export {tmp}/runs/nolist"),
    Case("predict-pickle-weights", "command", "predict {tmp}/runs/pickled hello"),
    Case("launch-job-name-refused", "launch", "launch --emit kubernetes --job_name My_Job -- fit toy --trainer.max_steps 2"),
    Case("launch-out-under-a-file", "output",
         "launch --emit slurm --out {tmp}/train.txt/job.sh -- fit toy --trainer.max_steps 2"),
]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = str(_free_port())
"""``{port}``: a port nothing listens on (one per test session)."""


def split_env(command: str) -> tuple[dict[str, str], str]:
    """The leading ``NAME=value`` words of ``command`` (set in the environment) and the rest."""
    words = command.split(" ")
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value.replace("{port}", PORT)
    return env, " ".join(words)


def expand(command: str, tmp: Path, tok: Path) -> list[str]:
    for name, base in BASES.items():
        command = command.replace(name, base)
    return [a.replace("{tmp}", str(tmp)).replace("{tok}", str(tok)).replace("{port}", PORT)
            for a in shlex.split(command)]


def normalise(text: str, tmp: Path, tok: Path) -> str:
    text = text.replace(str(tok), "{tok}").replace(str(tmp), "{tmp}").replace(f":{PORT} ", ":{port} ")
    return re.sub(r"-[0-9a-f]{32}\.arrow", "-{key}.arrow", text)  # a cache file's key holds the files' times


def _cut_tokenization_cache(folder: Path, tok: Path) -> None:
    """``folder/cache`` holding the tokenized rows of ``folder/train.txt`` (as the MLM recipe stores them), its
    Arrow file then cut to half, as a full disk or a killed copy would leave it."""
    from helpers import WORDS

    from zerotrain.data.text import load_packed
    from zerotrain.data.tokenizer import load_tokenizer

    folder.mkdir()
    (folder / "train.txt").write_text((" ".join(WORDS) + "\n") * 8)
    load_packed(str(folder / "train.txt"), load_tokenizer(str(tok)), 8, cache_dir=str(folder / "cache"))
    (arrow,) = (folder / "cache").glob("mlm-*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])


def make_inputs(tmp: Path) -> tuple[Path, Path]:
    """Every file and folder the cases name, under ``tmp``; returns (tmp, tokenizer folder)."""
    from helpers import WORDS

    tok = tmp / "tok"
    make_tokenizer(tok)
    (tmp / "cfgonly").mkdir()
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bare = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(["<unk>", *WORDS])}, unk_token="<unk>"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=bare, unk_token="<unk>").save_pretrained(tmp / "nopad")  # no pad, no EOS
    (tmp / "cfgonly" / "config.json").write_text('{"model_type": "roberta"}')
    (tmp / "train.txt").write_text(" ".join(WORDS) + "\n" * 1 + " ".join(reversed(WORDS)) + "\n")
    (tmp / "empty.txt").write_text("\n\n")
    _cut_tokenization_cache(tmp / "cut", tok)
    files = {
        "ok.json": {"zero_optimization": {"stage": 1}},
        "misspelt.json": {"zero_optimisation": {"stage": 2}},
        "zero_key.json": {"zero_optimization": {"stage": 2, "overlap_com": True}},
        "fp16_bf16.json": {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16.json": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
        "batch.json": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 100},
        "ac.json": {"activation_checkpointing": {"partition_activations": True}},
        "optimizer.json": {"optimizer": {"type": "AdamWW", "params": {"lr": 0.001}}},
        "offload.json": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "stage5.json": {"zero_optimization": {"stage": 5}},
        "auto.json": {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}},
        "list.json": [1, 2],
        "t_block_number.json": {"zero_optimization": 5},
        "t_micro_list.json": {"train_micro_batch_size_per_gpu": [1]},
        "t_clipping_text.json": {"gradient_clipping": "none"},
        "t_enabled_yes.json": {"fp16": {"enabled": "yes"}},
        "t_enabled_one.json": {"bf16": {"enabled": 1}, "fp16": {"enabled": 1}},
        "t_bucket_text.json": {"zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8"}},
        "t_pin_maybe.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "maybe"}}},
        "t_print_object.json": {"steps_per_print": {"a": 1}},
        "t_stage_true.json": {"zero_optimization": {"stage": True}},
        "accum_zero.json": {"gradient_accumulation_steps": 0},
        "offload_gpu.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
        "bucket_negative.json": {"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}},
        "scheduler_unknown.json": {"scheduler": {"type": "CosineAnnealing", "params": {}}},
        "comm_fp8.json": {"communication_data_type": "fp8"},
        "zenflow_top.json": {"zenflow": {"topk_ratio": 0.1}},
        "super_offload.json": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                        "super_offload": True}}},
        "ratio_stage2.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
        "bf16_master_nvme.json": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                                  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                          "nvme_path": "/tmp"}}},
        "zenflow_interval.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                        "zenflow": {"select_interval": 4}}},
        "lr.json": {"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}},
        "micro2.json": {"train_micro_batch_size_per_gpu": 2},
    }
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content))
    (tmp / "broken.json").write_text('{"zero_optimization": {"stage": 2}')
    (tmp / "yaml_body.json").write_text("zero_optimization:\n  stage: 2\ntrain_micro_batch_size_per_gpu: 4\n")
    (tmp / "unknown_key.yaml").write_text("trainer:\n  max_stepz: 3\n")
    (tmp / "broken.yaml").write_text("trainer: [\n")
    (tmp / "wrong_type.yaml").write_text("trainer:\n  max_steps: lots\n")
    (tmp / "old_layout.yaml").write_text("strategy:\n  zero_stage: 1\n  activation_checkpointing: true\n")
    (tmp / "section_scalar.yaml").write_text("trainer: 5\n")
    (tmp / "section_null.yaml").write_text("trainer:\n  max_steps: 1\nmodel: ~\n")
    (tmp / "list.yaml").write_text("- trainer\n- model\n")
    (tmp / "empty.yaml").write_text("# nothing yet\n")
    (tmp / "binary.yaml").write_bytes(b"trainer:\n  max_steps: \xff\xfe\x00\x01\n")
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"]  # nine levels of nine aliases each: 9**9 values once expanded
    bomb += [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    (tmp / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    one = [{"text": f"{WORDS[i % 20]} {WORDS[(i + 3) % 20]}", "label": 1} for i in range(16)]
    for folder, write in (("imdb_oneclass", lambda p, rows: p.write_text("\n".join(map(json.dumps, rows)) + "\n")),):
        (tmp / folder).mkdir()
        for split in ("train", "test"):
            write(tmp / folder / f"{split}.jsonl", one)
    (tmp / "imdb_ok").mkdir()
    for split in ("train", "test"):
        rows = [dict(row, label=i % 2) for i, row in enumerate(one)]
        (tmp / "imdb_ok" / f"{split}.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp / "imdb_notgz").mkdir()
    for split in ("train", "test"):
        (tmp / "imdb_notgz" / f"{split}.jsonl.gz").write_text("\n".join(map(json.dumps, one)) + "\n")
    (tmp / "imdb_garbage").mkdir()
    for split in ("train", "test"):
        (tmp / "imdb_garbage" / f"{split}.jsonl").write_bytes(bytes(range(128, 256)) * 4)
    llama = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64,
             "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2}
    (tmp / "llama.json").write_text(json.dumps(llama))
    (tmp / "lora.jsonl").write_text(json.dumps({"input": "the movie", "target": "was good"}) + "\n")
    (tmp / "lora_nofield.jsonl").write_text(json.dumps({"input": "the movie"}) + "\n")
    (tmp / "lora_broken.jsonl").write_text(json.dumps({"input": "a", "target": "b"}) + "\n{not json\n")
    bert = {"model_type": "bert", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 64, "vocab_size": 64, "pad_token_id": 1}
    (tmp / "bert.json").write_text(json.dumps(bert))
    chat = {"messages": [{"role": "user", "content": "the movie"}, {"role": "assistant", "content": "was good"}]}
    (tmp / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    (tmp / "chat_noanswer.jsonl").write_text(json.dumps({"messages": chat["messages"][:1]}) + "\n")
    (tmp / "sft_nofield.csv").write_text("input,answer\nthe movie,was good\nthe plot,was bad\n")
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["the movie was good", "the plot was bad"]}), tmp / "docs.parquet")
    datasets.Dataset.from_dict({"text": ["the movie was good"] * 4}).save_to_disk(str(tmp / "saved_text"))
    (tmp / "mixed").mkdir()
    (tmp / "mixed" / "a.txt").write_text("the movie was good\n")
    (tmp / "mixed" / "b.jsonl").write_text(json.dumps({"text": "the plot was bad"}) + "\n")
    lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    (tmp / "cls.jsonl").write_text(lines([{"text": "good", "label": "pos"}, {"text": "bad", "label": "neg"}]))
    (tmp / "cls_nolabel.jsonl").write_text(lines([{"text": "good", "label": "pos"}, {"text": "bad"}]))
    (tmp / "cls_badlabel.jsonl").write_text(lines([{"text": "good", "label": 1.5}]))
    (tmp / "cls_oneclass.jsonl").write_text(lines([{"text": "good", "label": "pos"}] * 2))
    (tmp / "cls_other.jsonl").write_text(lines([{"text": "fine", "label": "neutral"}]))
    (tmp / "cls_empty.jsonl").write_text("")
    (tmp / "cls_nolabel.csv").write_text("text,label\ngood,pos\nbad,\n")
    (tmp / "cls_badlabel.csv").write_text("text,label\ngood,1\nbad,-1\n")
    (tmp / "cls_header.csv").write_text("text,label\n")
    (tmp / "cls_list.jsonl").write_text(lines([{"text": "good", "label": "pos"}, ["bad", "neg"]]))
    (tmp / "mlm_nofield.csv").write_text("body\nthe movie was good\n")
    (tmp / "notes").mkdir()
    (tmp / "notes" / "README.md").write_text("notes, no data\n")
    # A finished toy run (checkpoint at step 1) and a run folder without checkpoints.
    from zerotrain.train.loop import fit
    from zerotrain.tasks.toy import ToyConfig, ToyTask

    cfg = ToyConfig()
    cfg.trainer.max_steps, cfg.trainer.num_workers, cfg.trainer.device = 1, 0, "cpu"
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp / "runs"), "toyrun"
    cfg.logging.progress_bar, cfg.logging.tensorboard = False, False
    fit(ToyTask(cfg))
    (tmp / "nockpt").mkdir()
    (tmp / "nockpt" / "hparams.json").write_text((tmp / "runs" / "toyrun" / "hparams.json").read_text())
    make_untrusted(tmp)
    return tmp, tok


class _Evil:
    """Unpickling this would create ``path``: what a crafted file would do instead (the cases check it does not)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def make_untrusted(tmp: Path) -> None:
    """Copies of the toy run, each with one thing someone else put there, and a run folder with a link out of it."""
    import hashlib
    import shutil

    runs = tmp / "runs"
    (runs / "linked").mkdir()
    (tmp / "outside.txt").write_text("not the run's\n")
    (runs / "linked" / "gitdiff.log").symlink_to(tmp / "outside.txt")

    def copy(name: str) -> tuple[Path, Path, dict]:
        shutil.copytree(runs / "toyrun", runs / name)
        (folder,) = (runs / name / "checkpoints").glob("step*")
        return runs / name, folder, json.loads((folder / "COMPLETE.json").read_text())

    _, folder, meta = copy("crafted")  # a pickle that would create {tmp}/code-ran, its marker edited to match
    weights = folder / "mp_rank_00_model_states.pt"
    weights.write_bytes(pickle.dumps({"module": _Evil(tmp / "code-ran")}))
    meta["files"][weights.name] = {"bytes": weights.stat().st_size,
                                   "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    (folder / "COMPLETE.json").write_text(json.dumps(meta))
    _, folder, _ = copy("flipped")  # one byte changed after the save
    data = bytearray((folder / "mp_rank_00_model_states.pt").read_bytes())
    data[-100] ^= 0xFF
    (folder / "mp_rank_00_model_states.pt").write_bytes(bytes(data))
    _, folder, meta = copy("nolist")  # a marker with no file list
    (folder / "COMPLETE.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    run, _, _ = copy("pickled")  # a pickle among the exported weights
    (run / "model" / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Evil(tmp / "code-ran")}))


_DERIVED_FROM_HOME = ("TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME")
"""Variables that replace a folder under HOME: a row that moves HOME is about those defaults, so the row runs
without them (CI sets TORCH_EXTENSIONS_DIR for its second venv)."""


def run_in_process(case: Case, tmp: Path, tok: Path, capsys) -> tuple[int, list[str]]:
    from zerotrain.cli import main

    import os

    env, command = split_env(case.command)
    cleared = _DERIVED_FROM_HOME if "HOME" in env else ()
    saved = {name: os.environ.get(name) for name in (*env, *cleared)}
    capsys.readouterr()
    try:
        for name in cleared:
            if name not in env:
                os.environ.pop(name, None)
        os.environ.update({k: v.replace("{tmp}", str(tmp)).replace("{tok}", str(tok)) for k, v in env.items()})
        code = main(expand(command, tmp, tok))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    err = capsys.readouterr().err
    lines = [normalise(line, tmp, tok) for line in err.splitlines() if line.strip()]
    return code, [line for line in lines if line.startswith(case.shows)]


# ---- the doc ----------------------------------------------------------------------------------

HEADER = "| id | input | command (after `zerotrain`) | exit | message (stderr, the whole of it) |"
_CELL = re.compile(r"(?<!\\)\|")


def _md(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _unmd(cell: str) -> str:
    cell = cell.strip()
    assert cell.startswith("`") and cell.endswith("`"), cell
    return cell[1:-1].replace("\\|", "|")


def doc_rows() -> dict[str, tuple[str, int, str]]:
    """id -> (command, exit status, message) from the table in docs/BAD_INPUTS.md, in order."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = _CELL.split(line)[1:-1]
        rows[cells[0].strip()] = (_unmd(cells[2]), int(cells[3]), _unmd(cells[4]))
    return rows


def write_doc(results: dict[str, tuple[int, list[str]]]) -> None:
    text = DOC.read_text(encoding="utf-8") if DOC.is_file() else ""
    head = text.split(HEADER)[0] if HEADER in text else "# Bad inputs\n\n"
    rows = [HEADER, "|---|---|---|---|---|"]
    for case in CASES:
        code, lines = results[case.id]
        rows.append(f"| {case.id} | {case.where} | {_md(case.command)} | {code} | {_md(' / '.join(lines))} |")
    tail = text.split(HEADER, 1)[1].split("\n\n", 1)[1] if HEADER in text and "\n\n" in text.split(HEADER, 1)[1] else ""
    DOC.write_text(head + "\n".join(rows) + "\n\n" + tail, encoding="utf-8")


# ---- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    return make_inputs(tmp_path_factory.mktemp("bad"))


def test_doc_lists_every_case():
    rows = doc_rows()
    assert list(rows) == [c.id for c in CASES]
    assert [cmd for cmd, _, _ in rows.values()] == [c.command for c in CASES]
    assert len(rows) >= 60


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, inputs, capsys):
    tmp, tok = inputs
    _, want_code, want = doc_rows()[case.id]
    code, lines = run_in_process(case, tmp, tok, capsys)
    assert (code, lines) == (want_code, [want])
    assert not (tmp / "code-ran").exists()  # no crafted file ran its code
    assert (tmp / "outside.txt").read_text() == "not the run's\n"  # nothing was written through a link
    assert code == case.code
    # What makes the line useful: which subcommand (a warning: what was repaired), and a flag, key or file it names.
    assert re.match(r"zerotrain( \w+)?: error: ", want) if code else want.startswith(case.shows)
    assert re.search(r"--\w|\{tmp\}|\{tok\}|\w+[._]\w+|'nosuch'", want)


def test_hparams_record_what_the_deepspeed_file_set(tmp_path):
    """A user's DeepSpeed file wins over the flags it overrides; hparams.json must say what the run used."""
    from zerotrain.train.loop import fit
    from zerotrain.tasks.toy import ToyConfig, ToyTask

    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.8, 0.9], "eps": 1e-6,
                                                   "weight_decay": 0.0, "torch_adam": True}}}))
    cfg = ToyConfig()
    cfg.strategy.deepspeed_config = str(tmp_path / "ds.json")
    cfg.trainer.max_steps, cfg.trainer.num_workers, cfg.trainer.device = 1, 0, "cpu"
    cfg.trainer.output_dir, cfg.trainer.run_name = str(tmp_path), "r"
    cfg.logging.progress_bar, cfg.logging.tensorboard = False, False
    fit(ToyTask(cfg))
    h = json.loads((tmp_path / "r" / "hparams.json").read_text())
    assert (h["strategy"]["zero_stage"], h["strategy"]["gradient_accumulation_steps"], h["trainer"]["micro_batch_size"],
            h["strategy"]["gradient_clipping"], h["strategy"]["reduce_bucket_size"]) == (2, 2, 4, 0.5, 1000)
    assert h["optimizer"] == {"name": "adamw", "lr": 0.003, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.0,
                              "momentum": 0.0}
    assert cfg.strategy.zero_stage == 0  # the caller's config is left as it was


def _read_only_home_works() -> str:
    """Why a read-only HOME cannot be made here ("" when it can): a read-only tmpfs mounted in a mount namespace
    of the command's own (``unshare``; a user namespace too when not root)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run([*_UNSHARE, "sh", "-c", "mount -t tmpfs -o ro,size=1m tmpfs /mnt && ! touch /mnt/x"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot mount a read-only tmpfs here: {probe.stderr.strip()[:200]}"


_UNSHARE = ["unshare", "-m"] + ([] if sys.platform != "linux" or __import__("os").geteuid() == 0 else ["-r"])


@pytest.mark.slow
@pytest.mark.parametrize("case_id,names", [("env-home-unwritable", "TORCH_EXTENSIONS_DIR"),
                                           ("env-home-unwritable-data-cache", "--data.cache_dir")])
def test_a_read_only_home_ends_in_the_line_that_names_what_to_set(case_id, names, inputs, tmp_path):
    """The rows put HOME under a file, which fails the same for every user. Here HOME is a read-only file system,
    which stops root too (a folder of mode 0555 would not): the same one line, naming what to set."""
    import subprocess

    why = _read_only_home_works()
    if why:
        pytest.skip(why)
    tmp, tok = inputs
    case = next(c for c in CASES if c.id == case_id)
    home = tmp_path / "home"
    home.mkdir()
    argv = expand(split_env(case.command)[1], tmp, tok)
    script = 'mount -t tmpfs -o ro,size=1m tmpfs "$HOME" && exec "$@"'
    out = subprocess.run([*_UNSHARE, "sh", "-c", script, "sh", sys.executable, "-m", "zerotrain", *argv],
                         cwd=tmp_path, env={k: v for k, v in child_env(argv, {"HOME": str(home)}).items()
                                               if k not in _DERIVED_FROM_HOME}, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("zerotrain fit: error: ") and names in lines[0], lines
    assert "(Read-only file system)" in lines[0] and (str(home) in lines[0] or "~/.cache" in lines[0]), lines


TWO_RANKS = ["mlm-missing-file", "tokenizer-config-only", "imdb-one-class", "resume-other-size", "json-fp16-on-cpu",
             "json-refused-while-building"]
"""Errors found inside the workers (after the launcher started them), where two ranks could disagree."""


@pytest.mark.slow
@pytest.mark.parametrize("case_id", TWO_RANKS)
def test_one_and_two_processes_print_the_same_line(case_id, inputs):
    tmp, tok = inputs
    case = next(c for c in CASES if c.id == case_id)
    _, want_code, want = doc_rows()[case_id]
    for nproc in (1, 2):
        out = zerotrain_cmd([*expand(case.command, tmp, tok), "--launch.nproc_per_node", str(nproc)], cwd=tmp)
        lines = [normalise(line, tmp, tok) for line in out.stderr.splitlines() if line.strip()]
        lines = [line for line in lines if line.startswith(case.shows)]
        assert (out.returncode, lines) == (want_code, [want]), (nproc, out.stderr[-2000:])


if __name__ == "__main__":  # regenerate the table: python tests/test_bad_inputs.py
    import tempfile

    class _Capture:
        def readouterr(self):
            out, err = sys.stdout.getvalue(), sys.stderr.getvalue()
            sys.stdout.seek(0), sys.stdout.truncate(), sys.stderr.seek(0), sys.stderr.truncate()
            return type("R", (), {"out": out, "err": err})()

    import io
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        tmp, tok = make_inputs(Path(d))
        real_out, real_err = sys.stdout, sys.stderr
        results = {}
        for case in CASES:
            sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
            try:
                results[case.id] = run_in_process(case, tmp, tok, _Capture())
            finally:
                sys.stdout, sys.stderr = real_out, real_err
            print(case.id, *results[case.id])
    write_doc(results)
