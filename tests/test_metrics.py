"""The measurement code behind metrics.jsonl and the benchmark tables."""

from __future__ import annotations

import pytest
import torch

from zerotrain.metrics import ThroughputMeter, peak_tflops


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H200", "fp16", 989.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 156.0), ("NVIDIA L40S", "bf16", 362.0), ("NVIDIA L40", "bf16", 181.0),
    ("NVIDIA L4", "bf16", 121.0), ("Some Future GPU", "bf16", None),
])
def test_peak_table(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_rates_use_reported_flops_and_skip_warmup():
    meter = ThroughputMeter(torch.device("cpu"), world_size=2, flops_per_token=10.0, precision="fp32", warmup_steps=1)
    meter.start()
    meter.add_step(micro_batches=1, samples=4, tokens=100)  # warm-up: not counted
    meter.add_step(micro_batches=2, samples=8, tokens=400, flops=1e6)  # measured FLOPs win
    meter.add_step(micro_batches=2, samples=8, tokens=400)  # fallback: 10 FLOPs per token
    rates = meter.read()
    # tokens/s counts both ranks; TFLOP/s is per GPU.
    assert rates["samples_per_s"] / rates["tokens_per_s"] == pytest.approx(16 / 800)
    assert rates["tflops_per_gpu"] * 1e12 / (rates["tokens_per_s"] / 2) == pytest.approx((1e6 + 4000) / 800)
    assert rates["sec_per_step"] * 2 == pytest.approx(rates["sec_per_batch"] * 4)
    assert "mfu" not in rates  # no peak for a CPU
    summary = meter.summary()
    assert summary["measured_steps"] == 2 and summary["tokens_per_s"] == pytest.approx(rates["tokens_per_s"])
