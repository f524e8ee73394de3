"""All measurement in one place: throughput, FLOPs utilisation, memory, data-loading stalls.

The training loop and the benchmark command both use :class:`ThroughputMeter`, so a number in
BENCHMARKS.md and a number in ``metrics.jsonl`` mean the same thing.

Timing rules: the clock is read after a device synchronisation, and the first
``--trainer.warmup_steps_excluded`` optimizer steps are left out (kernel compilation, allocator
growth, DeepSpeed's first-step bookkeeping).

MFU = achieved model FLOP/s per GPU / peak FLOP/s of that GPU at the training precision, where
achieved FLOP/s = ``flops_per_token`` x tokens / seconds. ``flops_per_token`` comes from the task
(6 x parameters for forward + backward, plus the attention term 12 x layers x width x sequence,
as in the PaLM paper's appendix B). Activation recomputation is not counted: MFU, not HFU.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil
import torch

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (bf16/fp16 tensor core, tf32 tensor core).
# Matched by substring of torch.cuda.get_device_name(); the first match wins, so specific names go first.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("H200", 989.0, 494.0),
    ("H100 PCIe", 756.0, 378.0),
    ("H100 NVL", 835.0, 418.0),
    ("H100", 989.0, 494.0),  # SXM / HBM3
    ("GH200", 989.0, 494.0),
    ("B200", 2250.0, 1100.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 60.0),
    ("A10G", 70.0, 35.0),
    ("A10", 125.0, 62.5),
    ("RTX 4090", 165.0, 82.6),
    ("RTX 3090", 71.0, 35.6),
    ("V100", 125.0, 15.7),  # no tf32: fp32 CUDA-core peak
    ("T4", 65.0, 8.1),
]


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """Peak dense TFLOP/s of one GPU at ``precision`` (fp32 counts as tf32), or None when unknown."""
    for key, half, tf32 in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tf32 if precision == "fp32" else half
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rss_gib() -> float:
    return psutil.Process().memory_info().rss / 2**30


def host_peak_rss_gib() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def gpu_memory_gib(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "gpu_mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "gpu_mem_reserved_peak_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


@dataclass
class Window:
    steps: int = 0
    micro_batches: int = 0
    samples: int = 0
    tokens: int = 0
    flops: float = 0.0
    data_wait_s: float = 0.0


class ThroughputMeter:
    """Accumulates work between two log points and turns it into rates.

    samples/s and tokens/s are job-wide: ``sum_across_ranks`` (an all-reduce, called by every rank
    at the same reads) adds up the ranks' counts, which differ when batches are padded to their own
    length. Without it, this rank's counts are multiplied by ``world_size``. TFLOP/s and MFU are the
    job's FLOPs divided by the number of GPUs.
    """

    def __init__(self, device: torch.device, world_size: int, flops_per_token: float, precision: str,
                 warmup_steps: int, sum_across_ranks: Optional[Callable[[dict[str, float]], dict[str, float]]] = None):
        self._sum = sum_across_ranks
        self.device = device
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.warmup_steps = warmup_steps
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.device_name = name
        self.peak = peak_tflops(name, precision) if device.type == "cuda" else None
        self.window = Window()
        self.steps_seen = 0
        self._t0: Optional[float] = None
        self.total = Window()
        self.total_seconds = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()
        self.window = Window()

    def add_data_wait(self, seconds: float) -> None:
        self.window.data_wait_s += seconds

    def add_step(self, micro_batches: int, samples: int, tokens: int, flops: Optional[float] = None) -> None:
        """Count one optimizer step's work. Steps in the warm-up restart the clock instead.

        ``flops``: the step's training FLOPs when the task measured them from the batch shapes;
        otherwise ``flops_per_token`` x ``tokens``.
        """
        self.steps_seen += 1
        if self.steps_seen <= self.warmup_steps:
            self.start()
            return
        w = self.window
        w.steps += 1
        w.micro_batches += micro_batches
        w.samples += samples
        w.tokens += tokens
        w.flops += flops if flops is not None else self.flops_per_token * tokens

    def read(self) -> dict[str, float]:
        """Rates for the window since the last read, then start a new window. Empty during warm-up."""
        synchronize(self.device)
        now = time.perf_counter()
        w = self.window
        ws = self.world_size
        counts = {"samples": float(w.samples), "tokens": float(w.tokens), "flops": w.flops}
        job = self._sum(counts) if self._sum else {k: v * ws for k, v in counts.items()}
        w.samples, w.tokens, w.flops = int(job["samples"]), int(job["tokens"]), job["flops"]
        out: dict[str, float] = {}
        if self._t0 is not None and w.steps > 0:
            elapsed = now - self._t0
            out = {
                "sec_per_step": elapsed / w.steps,
                "sec_per_batch": elapsed / w.micro_batches,
                "samples_per_s": w.samples / elapsed,
                "tokens_per_s": w.tokens / elapsed,
                "tflops_per_gpu": w.flops / ws / elapsed / 1e12,
                "data_wait_frac": min(1.0, w.data_wait_s / elapsed),
            }
            if self.peak:
                out["mfu"] = out["tflops_per_gpu"] / self.peak
            for k in ("steps", "micro_batches", "samples", "tokens", "flops"):
                setattr(self.total, k, getattr(self.total, k) + getattr(w, k))
            self.total.data_wait_s += w.data_wait_s
            self.total_seconds += elapsed
        self._t0 = now
        self.window = Window()
        return out

    def summary(self) -> dict[str, float]:
        """Rates over the whole run after warm-up (what a benchmark reports)."""
        t, s = self.total, self.total_seconds
        if not t.steps or s <= 0:
            return {}
        out = {
            "sec_per_step": s / t.steps,
            "sec_per_batch": s / t.micro_batches,
            "samples_per_s": t.samples / s,
            "tokens_per_s": t.tokens / s,
            "tflops_per_gpu": t.flops / self.world_size / s / 1e12,
            "data_wait_frac": t.data_wait_s / s,
            "measured_steps": t.steps,
        }
        if self.peak:
            out["mfu"] = out["tflops_per_gpu"] / self.peak
        return out


def memory_snapshot(device: torch.device) -> dict[str, float]:
    return {"host_rss_gib": host_rss_gib(), "host_rss_peak_gib": host_peak_rss_gib(), **gpu_memory_gib(device)}
