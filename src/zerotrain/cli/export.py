"""``zerotrain export RUN_DIR [--out DIR] [--step N] [--dtype fp32|bf16] [--format safetensors|hf]``.

Writes a run's checkpoint (the newest complete one, or --step N's) as consolidated weights, on a CPU,
from any ZeRO stage or the plain engine. safetensors: OUT/model/ in the recipe's layout and the run's
hparams.json, so `zerotrain predict OUT ...` reads it (lora: the peft adapter and the merged model);
hf (mlm, causal-lm, classify): a folder transformers' AutoModelForMaskedLM / AutoModelForCausalLM /
AutoModelForSequenceClassification .from_pretrained loads. Default OUT:
RUN_DIR/export/step<N>[-hf][-bf16].
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.checkpoint.export import export_run
from zerotrain.checkpoint.weights import parse_size
from zerotrain.errors import UserError


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain export", description=__doc__.split("\n\n")[1],
                                     allow_abbrev=False)
    parser.add_argument("run_dir", type=Path, help="a run directory (runs/<recipe>.<date>...) with checkpoints/step*/")
    parser.add_argument("--out", type=Path, default=None, help="new folder to write (default RUN_DIR/export/step<N>...)")
    parser.add_argument("--step", type=int, default=None, help="export this step's checkpoint (default: the newest complete)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="floating-point tensors are written in it")
    parser.add_argument("--format", default="safetensors", choices=["safetensors", "hf"],
                        help="safetensors (any recipe) or hf (mlm, causal-lm, classify: a Hugging Face folder)")
    parser.add_argument("--max_shard_size", default="5GB", help="split model.safetensors into shards past this size")
    args = parser.parse_args(argv)
    if args.step is not None and args.step < 0:
        raise UserError(f"--step must be >= 0, got {args.step}")



    try:
        if parse_size(args.max_shard_size) <= 0:
            raise ValueError
    except ValueError:
        raise UserError(f"--max_shard_size must be a positive size such as 5GB, 500MB or 2GiB, got "
                        f"{args.max_shard_size!r}") from None
    result = export_run(args.run_dir, out=args.out, step=args.step, dtype=args.dtype, fmt=args.format,
                        max_shard_size=args.max_shard_size, progress=lambda line: print(f"export: {line}", flush=True))
    print(f"exported step {result.step} of {args.run_dir} ({args.format}, {args.dtype}) to {result.out_dir}")
    for name in result.files:
        print(f"  {name}")
    return 0
