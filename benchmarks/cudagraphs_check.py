"""Do CUDA graphs (torch.compile mode="reduce-overhead") train the IMDB classifier as eager PyTorch does?

Preset (b)'s model (6 layers, 256 wide, vocabulary 50,265), the same initial weights and 40 identical
batches of 32 random reviews whose padded length changes from step to step (512, 128, 192, 128, 256, ...),
bf16 autocast, Adam (fused), clipping at 1.0: once eager and once with the whole model compiled under CUDA
graphs. Prints one RESULT line per dropout with the ratio of the two gradient norms, step by step. Right
gradients keep that ratio near 1 (dropout 0 exactly so, up to bf16 rounding).

    python benchmarks/cudagraphs_check.py            # dynamic shapes (torch's default)
    VARIANT=static python benchmarks/cudagraphs_check.py          # one graph per length (dynamic=False)
    VARIANT=static_nocudnn python benchmarks/cudagraphs_check.py  # the same, cuDNN attention off
    VARIANT=fallback_random python benchmarks/cudagraphs_check.py # inductor's RNG replaced by eager's
"""

from __future__ import annotations

import copy
import math
import os
import time

import torch

from zerotrain.models.sentiment import SentimentClassifier

DEVICE = torch.device("cuda")
LENGTHS = [512, 128, 192, 128, 256, 192, 64, 320, 128, 192] * 4


def batch(step: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 50000, (32, length), generator=g)
    mask = torch.ones(32, length, dtype=torch.long)
    for i, real in enumerate(torch.randint(length // 2, length + 1, (32,), generator=g)):
        mask[i, real:] = 0
        ids[i, real:] = 1
    labels = (ids[:, :8] > 25000).sum(1).remainder(2)
    return ids.to(DEVICE), mask.to(DEVICE), labels.to(DEVICE)


def train(model: torch.nn.Module, mark_steps: bool) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) of each step."""
    opt = torch.optim.Adam(model.parameters(), lr=2e-4, fused=True)
    out = []
    for step, length in enumerate(LENGTHS):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        ids, mask, labels = batch(step, length)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, mask, labels)["loss"]
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((float(loss), float(norm)))
    return out


def main() -> None:
    variant = os.environ.get("VARIANT", "dynamic")
    kwargs = {"mode": "reduce-overhead"}
    if variant.startswith("static"):
        kwargs["dynamic"] = False
        torch._dynamo.config.recompile_limit = 64  # one graph per length
    if variant.endswith("nocudnn"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if variant == "fallback_random":
        torch._inductor.config.fallback_random = True
    for dropout in (0.0, 0.2):
        torch.manual_seed(0)
        base = SentimentClassifier(50265, 256, 1024, 8, 6, 1024, dropout, pad_token_id=1).to(DEVICE)
        eager = train(copy.deepcopy(base), mark_steps=False)
        torch._dynamo.reset()
        graphed = copy.deepcopy(base)
        graphed.compile(**kwargs)
        start = time.time()
        got = train(graphed, mark_steps=True)
        # The ratio farthest from 1 either way: a norm that collapses is as wrong as one that explodes
        worst = max((g[1] / e[1] for g, e in zip(got, eager)), key=lambda r: abs(math.log(r)))
        print(f"RESULT variant={variant} dropout={dropout} ({time.time() - start:.0f} s) worst norm ratio "
              f"{worst:.2f}; loss at step 40: eager {eager[-1][0]:.4f}, graphs {got[-1][0]:.4f}; norms "
              "graphs/eager, steps 1-12: " + " ".join(f"{g[1]:.1f}/{e[1]:.1f}" for g, e in list(zip(got, eager))[:12]),
              flush=True)


if __name__ == "__main__":
    main()
