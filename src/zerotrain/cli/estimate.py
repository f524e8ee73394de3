"""``zerotrain estimate RECIPE [fit flags] [--gpu_memory_gib X] [--reserve_gib R]``.

Builds the recipe's model on PyTorch's meta device (no memory, no weights read), counts its
parameters and prints the model-state memory of every strategy per GPU and per process in host
memory, and the fastest strategy whose states fit. The GPUs are those of the fit flags
(``--launch.nproc_per_node`` per host x ``--launch.nnodes``). Activations are not included: keep room
for them with --reserve_gib, and confirm the pick with ``zerotrain benchmark``.
"""

from __future__ import annotations

import argparse

import psutil
import torch

from zerotrain import recipes
from zerotrain.cli.fit import parse_config
from zerotrain.ds_config import make_ds_config
from zerotrain.memory import GIB, Buckets, count_params, gpu_memory_bytes, plan
from zerotrain.strategies import STRATEGIES


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain estimate", description=__doc__.split("\n\n")[1])
    parser.add_argument("recipe", choices=list(recipes.RECIPES))
    parser.add_argument("--gpu_memory_gib", type=float, default=None, help="memory of one GPU (default: GPU 0's)")
    parser.add_argument("--host_memory_gib", type=float, default=None, help="memory of one host (default: this one's)")
    parser.add_argument("--reserve_gib", type=float, default=0.0,
                        help="GPU memory kept for activations and the CUDA context when judging what fits")
    args, fit_args = parser.parse_known_args(argv)
    cfg = parse_config(args.recipe, fit_args)
    if cfg.trainer.max_steps is None and cfg.trainer.epochs is None:
        cfg.trainer.max_steps = 1  # the run's length does not change its memory; fit's check needs one
    cfg.validate()
    per_node = cfg.launch.nproc_per_node
    world = per_node * cfg.launch.nnodes
    if cfg.strategy.precision == "auto":
        cfg.strategy.precision = "bf16"  # what auto resolves to on any GPU since Ampere; the model is built in it
    precision = cfg.strategy.precision
    # Bucket sizes as DeepSpeed would get them: from the flags, or from --strategy.deepspeed_config.
    buckets = Buckets.from_ds_config(make_ds_config(cfg, world, "cuda", precision))

    _, task_cls = recipes.load(args.recipe)
    with torch.device("meta"):
        model = task_cls(cfg).build_model()
    counts = count_params(model)

    gpu = args.gpu_memory_gib * GIB if args.gpu_memory_gib is not None else gpu_memory_bytes()
    host = args.host_memory_gib * GIB if args.host_memory_gib is not None else float(psutil.virtual_memory().total)
    rows = plan(counts, world, precision, gpu if gpu is not None else float("inf"), host,
                procs_per_host=per_node,
                reserve_bytes=args.reserve_gib * GIB, buckets=buckets)

    print(f"{args.recipe}: {counts.total:,} parameters, {counts.trainable:,} trainable, "
          f"largest layer {counts.largest_layer:,}; {precision}, {world} GPU(s)")
    gpu_text = f"{gpu / GIB:.1f} GiB per GPU" if gpu is not None else "GPU memory unknown (no GPU here: pass --gpu_memory_gib)"
    print(f"{gpu_text}, {host / GIB:.1f} GiB host memory, {args.reserve_gib:g} GiB reserved for activations\n")
    print("| strategy | model states per GPU (GiB) | offloaded per process (GiB) | fits |")
    print("|---|---|---|---|")
    for row in rows:
        fits = ("yes" if row.fits else "no") if gpu is not None else "?"
        print(f"| {row.name} | {row.memory.gpu_bytes / GIB:.2f} | {row.memory.cpu_bytes / GIB:.2f} | {fits} |")
    print("\nModel states only (weights, gradients, optimizer, DeepSpeed's reduce bucket); activations come on top.")
    if gpu is None:
        return 0
    pick = next((row.name for row in rows if row.fits), None)
    if pick is None:
        print("Nothing fits: add GPUs (--launch.nproc_per_node, --launch.nnodes), train fewer parameters "
              "(the lora recipe), or lower --reserve_gib.")
        return 1
    flags = " ".join(STRATEGIES[pick].flags())
    print(f"Pick: {pick}   ->   zerotrain fit {args.recipe} ... {flags}")
    print(f"Check it: zerotrain benchmark {args.recipe} --strategies {pick} ... (measures activations too)")
    return 0

