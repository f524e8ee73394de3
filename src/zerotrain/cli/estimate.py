"""``zerotrain estimate RECIPE [fit flags] [--gpu_memory_gib X] [--reserve_gib R]``.

Builds the recipe's model on PyTorch's meta device (no memory, no weights read), counts its
parameters and prints the model-state memory of every strategy per GPU and per process in host
memory, and the first strategy (in a fixed order) whose states fit; ``zerotrain plan`` finds the fastest. The GPUs are those of the fit flags
(``--launch.nproc_per_node`` per host x ``--launch.nnodes``). With --measure the activations are measured
on this machine and added; without it keep room for them with --reserve_gib.
"""

from __future__ import annotations

import argparse

from zerotrain.config.flags import parse_config
from zerotrain.plan.estimate import estimate, format_report
from zerotrain.plan.probe import run_probe


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain estimate", description=__doc__.split("\n\n")[1])
    parser.add_argument("recipe", help="a recipe name (zerotrain fit --help lists them) or module:Class, a Task "
                        "subclass of your own")
    parser.add_argument("--gpu_memory_gib", type=float, default=None, help="memory of one GPU (default: GPU 0's)")
    parser.add_argument("--host_memory_gib", type=float, default=None, help="memory of one host (default: this one's)")
    parser.add_argument("--reserve_gib", type=float, default=0.0,
                        help="GPU memory kept for activations and the CUDA context when judging what fits")
    parser.add_argument("--measure", action="store_true",
                        help="measure the activations on this machine (the real model and data, a few seconds) and add them")
    args, fit_args = parser.parse_known_args(argv)
    cfg = parse_config(args.recipe, fit_args)
    probe = None
    if args.measure:
        import tempfile
        from pathlib import Path


        with tempfile.TemporaryDirectory() as tmp:
            probe = run_probe(args.recipe, fit_args, Path(tmp) / "probe.json", cfg.trainer.micro_batch_size)
    report = estimate(args.recipe, cfg, gpu_memory_gib=args.gpu_memory_gib, host_memory_gib=args.host_memory_gib,
                      reserve_gib=args.reserve_gib, probe=probe)
    print(format_report(report))
    return 1 if report.gpu_bytes is not None and report.pick is None else 0
