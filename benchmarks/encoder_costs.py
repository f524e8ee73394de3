"""What each part of a BERT-base encoder step costs on this GPU: dropout, the attention kernel, the compile mode.

The profile of a full MLM step (``zerotrain benchmark --profile``) says that norm/elementwise kernels
take a third of the GPU time, but not why. This times the forward and backward of zerotrain's own
``Encoder`` (12 layers, 768 wide, 12 heads, FFN 3072), compiled as one graph as ``--compile.scope
stack`` does, in bf16, micro-batch x sequence as given, under variants that change one thing each:

* ``base``: as trained (dropout 0.1 on the hidden states and inside attention, torch's pick of SDPA kernel);
* ``no_dropout`` / ``no_attn_dropout`` / ``no_hidden_dropout``: what dropout costs, and where (diagnostic:
  these change the model, they are not offered as speed-ups);
* ``sdpa_flash`` / ``sdpa_efficient`` / ``sdpa_cudnn``: one SDPA kernel family allowed;
* ``max_autotune``: inductor's max-autotune-no-cudagraphs (Triton matmuls with fused epilogues), time-boxed;
* ``autocast``: float32 weights under bf16 autocast, as ZeRO-0 and the plain engine run bf16, and
  ``autocast_fp32_ln``: the same with torch's own LayerNorm, whose float32 output makes the residual stream float32;
* ``align_random_eager``: inductor's dropout drawn as eager's kernel draws it (where this torch has the switch).

and times scaled_dot_product_attention alone (forward + backward) for each kernel family, with and
without dropout. Each variant is a fresh model and a fresh compile; times are CUDA-event medians.

    python benchmarks/encoder_costs.py OUT_DIR [--batch 32] [--seq 512] [--iters 30] [--variants base,...]

Writes ``OUT_DIR/encoder_costs.json`` and ``.md`` (with the top kernels of ``base`` and of the fastest
variant that keeps the model unchanged).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from zerotrain.models.roberta_mlm import Encoder, SelfAttention

DIMS = dict(vocab_size=50265, num_layers=12, num_heads=12, h_dim=768, ff_dim=3072, max_seq_length=512,
            pad_token_id=1, activation_checkpointing=False)
BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
SAME_MODEL = ("base", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "max_autotune", "align_random_eager")
AUTOCAST = ("autocast", "autocast_fp32_ln")


def cuda_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextmanager
def variant_settings(name: str):
    backend = BACKENDS.get(name)
    with sdpa_kernel([backend]) if backend else nullcontext(), \
            torch.autocast("cuda", dtype=torch.bfloat16) if name in AUTOCAST else nullcontext():
        yield



def build(name: str, batch: int, seq: int):
    torch._dynamo.reset()
    dropout = 0.0 if name == "no_dropout" else 0.1
    enc = Encoder(dropout=dropout, **DIMS).cuda().train()
    if name not in AUTOCAST:
        enc.bfloat16()
    if name == "autocast_fp32_ln":
        for m in enc.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.__class__ = torch.nn.LayerNorm  # torch's forward: float32 out under autocast
    if hasattr(inductor_config, "align_random_eager"):
        inductor_config.align_random_eager = name == "align_random_eager"
    if name == "no_hidden_dropout":
        for m in enc.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    if name == "no_attn_dropout":
        for m in enc.modules():
            if isinstance(m, SelfAttention):
                m.dropout = 0.0
    mode = "max-autotune-no-cudagraphs" if name == "max_autotune" else None
    enc.compile(**({"mode": mode} if mode else {}))
    ids = torch.randint(3, DIMS["vocab_size"], (batch, seq), device="cuda")
    grad = torch.randn(batch, seq, DIMS["h_dim"], device="cuda", dtype=torch.bfloat16)

    def step():
        enc.zero_grad(set_to_none=True)  # as a training step does: gradients are written, not accumulated
        enc(ids, None).backward(grad)
    return enc, step


def time_variant(name: str, batch: int, seq: int, iters: int) -> dict:
    with variant_settings(name):
        t0 = time.perf_counter()
        _, step = build(name, batch, seq)
        step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        ms = cuda_ms(step, iters)
    return {"variant": name, "fwd_bwd_ms": ms, "compile_s": compile_s, "same_model": name in SAME_MODEL}


def top_kernels(name: str, batch: int, seq: int, n: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    with variant_settings(name):
        _, step = build(name, batch, seq)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return [{"kernel": e.key[:110], "calls_per_step": e.count / 5, "ms_per_step": e.device_time_total / 5e3}
            for e in rows[:n]]


def sdpa_alone(batch: int, seq: int, iters: int) -> list[dict]:
    heads, dim = DIMS["num_heads"], DIMS["h_dim"] // DIMS["num_heads"]
    rows = []
    for label, backend in BACKENDS.items():
        for p in (0.1, 0.0):
            q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn_like(q)

            def step():
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, dropout_p=p).backward(g)
            try:
                ms = cuda_ms(step, iters)
                status = "ok"
            except RuntimeError as e:
                ms, status = None, str(e).splitlines()[0][:120]
            rows.append({"backend": label, "dropout": p, "fwd_bwd_ms_per_layer": ms, "status": status})
    return rows


def environment() -> dict:
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "cudnn": torch.backends.cudnn.version()}
    try:
        from torch._inductor.runtime import triton_helpers
        env["inductor_rand4x"] = hasattr(triton_helpers, "rand4x")
    except ImportError as e:
        env["inductor_rand4x"] = f"unknown: {e}"
    for pkg in ("flash_attn", "flash_attn_interface", "transformer_engine", "apex"):
        try:
            __import__(pkg)
            env[pkg] = "importable"
        except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
            env[pkg] = f"no ({type(e).__name__})"
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default="base,no_dropout,no_attn_dropout,no_hidden_dropout,sdpa_flash,"
                                          "sdpa_efficient,sdpa_cudnn,max_autotune")
    ap.add_argument("--profile", default="base", help="variants whose top kernels to list (and the fastest same-model one)")
    ap.add_argument("--max_autotune_budget_s", type=float, default=240.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "batch": args.batch, "seq": args.seq, "iters": args.iters,
              "command": "python benchmarks/encoder_costs.py " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
              "sdpa_alone": sdpa_alone(args.batch, args.seq, args.iters), "variants": []}
    started = time.perf_counter()
    for name in args.variants.split(","):
        if name == "max_autotune" and time.perf_counter() - started > args.max_autotune_budget_s:
            result["variants"].append({"variant": name, "status": "skipped: out of time"})
            continue
        try:
            if name == "align_random_eager" and not hasattr(inductor_config, "align_random_eager"):
                raise RuntimeError(f"torch {torch.__version__} has no inductor.config.align_random_eager")
            row = time_variant(name, args.batch, args.seq, args.iters)
        except Exception as e:  # noqa: BLE001 - a failed variant is a result row, the others still run
            row = {"variant": name, "status": f"failed: {str(e).splitlines()[0][:160]}"}
        result["variants"].append(row)
        print(json.dumps(row), flush=True)
        _write(args.out, result)
    timed = [r for r in result["variants"] if "fwd_bwd_ms" in r]
    fastest = min((r for r in timed if r["same_model"]), key=lambda r: r["fwd_bwd_ms"], default=None)
    result["top_kernels"] = {name: top_kernels(name, args.batch, args.seq) for name in args.profile.split(",") if name}
    if fastest and fastest["variant"] not in result["top_kernels"]:
        result["top_kernels"][fastest["variant"]] = top_kernels(fastest["variant"], args.batch, args.seq)
    _write(args.out, result)
    return 0


def _write(out: Path, result: dict) -> None:
    (out / "encoder_costs.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Encoder forward + backward costs ({result['environment']['gpu']})", "",
             f"`{result['command']}`", "", json.dumps(result["environment"]), "",
             "| variant | same model | fwd+bwd ms | compile s |", "|---|---|---|---|"]
    for r in result["variants"]:
        if "fwd_bwd_ms" in r:
            lines.append(f"| {r['variant']} | {r['same_model']} | {r['fwd_bwd_ms']:.2f} | {r['compile_s']:.0f} |")
        else:
            lines.append(f"| {r['variant']} | | {r['status']} | |")
    lines += ["", "| SDPA alone, one layer | dropout | fwd+bwd ms |", "|---|---|---|"]
    for r in result["sdpa_alone"]:
        ms = f"{r['fwd_bwd_ms_per_layer']:.3f}" if r["fwd_bwd_ms_per_layer"] is not None else r["status"]
        lines.append(f"| {r['backend']} | {r['dropout']} | {ms} |")
    for name, rows in result.get("top_kernels", {}).items():
        lines += ["", f"Top kernels, {name}:", "", "| kernel | calls/step | ms/step |", "|---|---|---|"]
        lines += [f"| `{r['kernel']}` | {r['calls_per_step']:.0f} | {r['ms_per_step']:.3f} |" for r in rows]
    (out / "encoder_costs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
