"""Why does a ZeRO-3 run keep its CPU-built model on the host? (LoRA 1.2B: 4.40 GiB steady under ZeRO-3, 2.27
under ZeRO-2, BENCHMARKS.md session 10.) Builds the recipe's model as `zerotrain fit` does, starts the engine on
one process, and reports the resident memory at each point and every large CPU tensor still alive, with what refers
to it. (It answered: nothing; the engine frees the CPU-built model, and the extra comes from the export.)

    python benchmarks/zero3_host_check.py lora [fit flags] --strategy.zero_stage 3
"""

from __future__ import annotations

import gc
import sys

import psutil
import torch


def rss() -> str:
    return f"{psutil.Process().memory_info().rss / 2**30:.2f} GiB"


def main(recipe: str, args: list[str]) -> None:
    from zerotrain import distributed, recipes
    from zerotrain.config_cli import parse_config
    from zerotrain.ds_config import resolve_precision
    from zerotrain.engine import build_engine

    cfg = parse_config(recipe, args)
    with distributed.setup(cfg):
        device = torch.device("cuda")
        precision = resolve_precision(cfg.precision.dtype, "cuda", True)
        task = recipes.get(recipe)(cfg)
        task.build_datasets()
        print("data loaded:", rss(), flush=True)
        model = task.build_model()
        print("model built:", rss(), flush=True)
        engine = build_engine(model, cfg, device, precision, 10, 10, 1, task.deepspeed_hints(model))
        gc.collect()
        print("engine built:", rss(), flush=True)
        found = {}
        for obj in gc.get_objects():  # CPU tensors of any size worth a look, and what refers to them
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.numel() > 10**6:
                key = f"{tuple(obj.shape)} {obj.dtype}"
                found.setdefault(key, [type(r).__name__ for r in gc.get_referrers(obj)][:5])
        total = sum(1 for _ in found)
        print(f"large CPU tensors alive ({total} shapes):", dict(list(found.items())[:12]), flush=True)
        # ZeRO-3's partitioned parameters are empty placeholders: their size is ds_numel
        sizes = [(p.device.type, getattr(p, "ds_numel", p.numel())) for p in model.parameters()]
        cuda_params = sum(n for kind, n in sizes if kind == "cuda")
        cpu_params = sum(n for kind, n in sizes if kind == "cpu")
        print(f"parameters on cuda {cuda_params:,}, on cpu {cpu_params:,}", flush=True)
        del engine


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
