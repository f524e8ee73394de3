"""Does the IMDB classifier compiled whole (``--compile.scope model``) train as eager does on a GPU?

Preset (b)'s model shape, two copies with the same weights, the same batches of random reviews whose padded
length changes from step to step, Adam, one step each. Prints the ratio of the compiled gradient norm to eager's
per step, and the largest departure. Right gradients keep the ratio at 1 up to rounding. One variant a process:

    python benchmarks/whole_compile_check.py VARIANT

VARIANT: blocks (each block compiled, the control), model (whole, bf16 autocast), model_fp32 (no autocast),
model_math / model_efficient / model_cudnn (whole, bf16, only that attention kernel allowed), encoder (the stack
of layers compiled as one graph, embedding and head eager). Each also prints, at the first step whose ratio is
off by more than 20%, the five parameters whose gradients differ most from eager's (relative error).
"""

from __future__ import annotations

import copy
import math
import sys

import torch

from cudagraphs_check import batch  # the CUDA-graph check's reviews (run as benchmarks/whole_compile_check.py)
from zerotrain.compiling import compile_in_place, compile_model
from zerotrain.models.sentiment import SentimentClassifier

LENGTHS = [512, 128, 192, 128, 256, 192, 64, 320, 128, 192, 512, 64]  # the lengths of session 11's results

def main() -> None:
    variant = sys.argv[1]
    device = torch.device("cuda")
    only = variant.removeprefix("model_")
    if only in ("math", "efficient", "cudnn"):
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_math_sdp(only == "math")
        torch.backends.cuda.enable_mem_efficient_sdp(only == "efficient")
        torch.backends.cuda.enable_cudnn_sdp(only == "cudnn")
    dtype = None if variant == "model_fp32" else torch.bfloat16
    torch.manual_seed(0)
    eager = SentimentClassifier(50265, 256, 1024, 8, 6, 1024, 0.0, pad_token_id=1).to(device)
    compiled = copy.deepcopy(eager)
    if variant == "encoder":
        print(variant, compile_model(compiled, "stack"), flush=True)
    elif variant == "blocks":
        print(variant, compile_model(compiled, "blocks"), flush=True)
    else:  # the whole model as one graph, which zerotrain no longer offers (calls A-D ran it as compile_scope model)
        compile_in_place(compiled)
        print(variant, "compiled the whole SentimentClassifier", flush=True)
    shown = False
    models = (eager, compiled)
    opts = [torch.optim.Adam(m.parameters(), lr=2e-4) for m in models]
    ratios = []
    for step, length in enumerate(LENGTHS):
        norms = []  # clipped in place, so the errors below compare clipped gradients
        for model in models:
            ids, mask, labels = batch(step, length)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(ids, mask, labels)["loss"]
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        ratios.append(norms[1] / norms[0])
        if not shown and abs(math.log(ratios[-1])) > math.log(1.2):
            shown = True
            errors = []
            for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
                errors.append((float((a.grad - b.grad).norm() / a.grad.norm().clamp(min=1e-12)), name))
            print(f"step {step} (length {length}): largest relative gradient errors "
                  + ", ".join(f"{n} {e:.3g}" for e, n in sorted(errors, reverse=True)[:5]), flush=True)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    print(f"RESULT {variant}: worst norm ratio {worst:.3g}; per step " + " ".join(f"{r:.2f}" for r in ratios),
          flush=True)


if __name__ == "__main__":
    main()
