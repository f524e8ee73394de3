"""The comparison row for a Hugging Face recipe (causal-lm, lora): the same model and data through the Hugging
Face Trainer, measured the way zerotrain measures (synchronised clock, warm-up steps excluded).

    python benchmarks/hf_trainer.py --recipe causal-lm --out ROW.json [--trainer_args JSON] -- <zerotrain fit flags>
    torchrun --nproc-per-node N benchmarks/hf_trainer.py ...     (several GPUs; rank 0 writes the row)

The model and the tokenised data come from zerotrain's task, so the rows differ only in the training loop and
engine set-up around them. The Trainer gets the DeepSpeed JSON of ``--strategy.deepspeed_config`` when the flags
name one (none: the Trainer alone), and ``--trainer_args`` adds TrainingArguments of its own (``torch_compile``,
``optim``, ``use_liger_kernel``), so that it runs with its own best settings. Packed causal-LM rows reach it as
``run_clm`` makes them: one causal sequence a row, no position restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="lora", help="a Hugging Face recipe of zerotrain: lora, causal-lm")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trainer_args", default="{}", help="TrainingArguments of the Trainer's own, as JSON")
    args, rest = p.parse_known_args()
    fit_flags = rest[1:] if rest[:1] == ["--"] else rest

    from zerotrain.runtime.distributed import free_port
    from zerotrain.runtime.launcher import sanitize_cuda_arch_list

    # One process without a launcher: DeepSpeed inside the Trainer still wants torchrun's variables.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as zerotrain does for CPU runs
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zerotrain.config.ds_config import load_user_config
    from zerotrain.config.flags import parse_config
    from zerotrain.metrics.meters import peak_tflops
    from zerotrain.tasks import registry
    from zerotrain.train.loop import seed_everything

    sanitize_cuda_arch_list()
    cfg = parse_config(args.recipe, fit_flags).validate()
    if cfg.trainer.max_steps is None or cfg.trainer.max_steps <= args.warmup:
        p.error(f"--trainer.max_steps must be set and larger than --warmup ({args.warmup}): "
                "the row times the steps after the warm-up")
    task = registry.get(args.recipe)(cfg)
    seed_everything(cfg.trainer.seed)
    splits = task.build_datasets()
    tr, st = cfg.trainer, cfg.strategy
    precision = "bf16" if cfg.precision.dtype in ("auto", "bf16") else cfg.precision.dtype
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Meter(TrainerCallback):
        def __init__(self):
            self.t0, self.steps, self.seen = None, 0, 0

        def on_step_begin(self, a, state, control, **kw):
            if self.seen == args.warmup:
                sync()
                self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.seen += 1
            if self.seen > args.warmup:
                self.steps += 1

    meter = Meter()
    tokens_per_micro_batch, real_tokens_per_micro_batch = [], []

    class CountingTrainer(Trainer):
        # Counted here, in the main process (the collate function may run in data-loader workers), on tensors
        # still on the CPU (the Trainer moves them inside training_step): no device sync.
        def training_step(self, model, inputs, *rest, **kw):
            tokens_per_micro_batch.append(inputs["input_ids"].numel())
            if "tokens" in inputs:  # packed rows: their real tokens; the Trainer's rows restart no positions
                real_tokens_per_micro_batch.append(int(inputs.pop("tokens").sum()))
                inputs.pop("position_ids", None)
            else:
                real_tokens_per_micro_batch.append(int(inputs["attention_mask"].sum()))
            return super().training_step(model, inputs, *rest, **kw)

    extra = json.loads(args.trainer_args)
    # TrainingArguments first, as the Trainer's DeepSpeed guide has it: under a ZeRO-3 JSON, a model built after
    # them is built partitioned (zero.Init), as a user of the Trainer gets it.
    targs = TrainingArguments(
        output_dir="/tmp/hf_trainer_bench", per_device_train_batch_size=tr.micro_batch_size,
        gradient_accumulation_steps=st.gradient_accumulation_steps, learning_rate=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay, max_grad_norm=st.gradient_clipping, max_steps=tr.max_steps,
        warmup_steps=cfg.scheduler.warmup_steps, lr_scheduler_type="constant_with_warmup", bf16=precision == "bf16",
        fp16=precision == "fp16", logging_steps=10, save_strategy="no", report_to=[], seed=tr.seed,
        # The parsed file: the Trainer's json.load cannot read the '#' comment of the tutorial's JSON.
        deepspeed=load_user_config(st.deepspeed_config) if st.deepspeed_config else None,
        dataloader_num_workers=tr.num_workers, remove_unused_columns=False, disable_tqdm=True, **extra,
    )
    model = task.build_model()
    flops_per_token = task.flops_per_token(model)
    trainer = CountingTrainer(model=model, args=targs, train_dataset=splits.train, data_collator=task.collator(),
                      callbacks=[meter])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    sync()
    seconds = time.perf_counter() - meter.t0
    gas = st.gradient_accumulation_steps
    window = slice(args.warmup * gas, (args.warmup + meter.steps) * gas)
    measured_tokens = sum(tokens_per_micro_batch[window])
    real_tokens = sum(real_tokens_per_micro_batch[window])
    name = torch.cuda.get_device_name() if cuda else "cpu"
    tflops = flops_per_token * measured_tokens / seconds / 1e12
    peak = peak_tflops(name, precision)
    row = {
        "strategy": "hf_trainer" + ("+deepspeed" if st.deepspeed_config else ""), "trainer_args": extra,
        "nproc": world, "world_size": world, "device": name, "deepspeed_config": st.deepspeed_config,
        "command": " ".join(["python", *sys.argv]),
        # Counted on this rank; every rank trains as many tokens a step, so the job's rate is world x these.
        "throughput_sec_per_step": seconds / meter.steps, "throughput_tokens_per_s": world * measured_tokens / seconds,
        "throughput_real_tokens_per_s": world * real_tokens / seconds, "tokens_per_s": world * real_tokens / seconds,
        "tokens_per_s_per_gpu": real_tokens / seconds,
        "throughput_tflops_per_gpu": tflops, "throughput_mfu": tflops / peak if peak else None,
        "gpu_mem_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "measured_steps": meter.steps, "measured_tokens": measured_tokens,
    }
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)
        print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
