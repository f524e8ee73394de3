"""The measurement code behind metrics.jsonl and the benchmark tables."""

from __future__ import annotations

import json
import time

import pytest
import torch

from zerotrain.metrics.meters import ThroughputMeter, peak_tflops


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


def _spin_or_sleep(seconds: float, sleep: bool) -> None:

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if sleep:
            time.sleep(seconds)


def test_the_meter_tells_a_thread_on_the_cpu_from_one_off_it():
    """host_cpu_frac is the loop thread's time on a CPU over the wall time: near 1 when the step spins on the
    host, near 0 when it sleeps. On a loaded machine a spinning thread may wait for a CPU instead, which
    host_runqueue_frac counts: the two together stay near 1. Bounds far apart, so load cannot flip them."""

    def measured(sleep: bool) -> dict:
        meter = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=0)
        meter.start()
        _spin_or_sleep(0.3, sleep)
        meter.add_step(micro_batches=1, samples=1, tokens=1)
        return {**meter.read(), **{f"total_{k}": v for k, v in meter.summary().items()}}

    busy, idle = measured(sleep=False), measured(sleep=True)
    assert idle["host_cpu_frac"] < 0.2 and busy["host_cpu_frac"] <= 1.05
    assert busy["host_cpu_frac"] + busy.get("host_runqueue_frac", 0.0) > 0.5
    assert busy["total_host_cpu_frac"] == pytest.approx(busy["host_cpu_frac"])
    for rates in (busy, idle):
        assert rates.get("host_runqueue_frac", 0.0) >= 0 and 0 <= rates.get("host_steal_frac", 0.0) <= 1.05
        assert rates["host_cpu_frac"] + rates.get("host_runqueue_frac", 0.0) <= 1.1


def test_warm_up_steps_restart_the_host_clocks_too():
    """A spinning warm-up step is left out of the host shares as it is of the throughput."""
    meter = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=1)
    meter.start()
    _spin_or_sleep(0.3, sleep=False)
    meter.add_step(micro_batches=1, samples=1, tokens=1)  # warm-up: restarts every clock
    _spin_or_sleep(0.3, sleep=True)
    meter.add_step(micro_batches=1, samples=1, tokens=1)
    assert meter.read()["host_cpu_frac"] < 0.2


def test_a_read_from_another_thread_reports_no_host_shares():
    """Thread clocks compare only within one thread: a read elsewhere leaves the shares out, not wrong."""
    import threading

    meter = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=0)
    meter.start()
    meter.add_step(micro_batches=1, samples=1, tokens=1)
    rates: dict = {}
    t = threading.Thread(target=lambda: rates.update(meter.read()))
    t.start()
    t.join()
    assert rates["sec_per_step"] > 0 and not any(k.startswith("host_") for k in rates)
    assert not any(k.startswith("host_") for k in meter.summary())


def test_host_clocks_the_system_does_not_keep_are_missing_not_zero(tmp_path):
    """gVisor's /proc/stat is all zeros and it has no schedstat: those shares are left out rather than
    reported as 0, which would read as "no steal, no wait". A real file is parsed field by field."""
    import os

    from zerotrain.metrics.meters import HostClock

    zeros = tmp_path / "stat"
    zeros.write_text("cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
    clock = HostClock.read(schedstat=tmp_path / "absent", stat=zeros)
    assert clock.steal_s is None and clock.runqueue_s is None and clock.preemptions is None and clock.cpu_s > 0
    real, sched = tmp_path / "stat_real", tmp_path / "schedstat"
    real.write_text("cpu  100 0 50 1000 5 0 1 40 0 0\n")
    sched.write_text("123 2500000000 7\n")
    clock = HostClock.read(schedstat=sched, stat=real)
    assert clock.runqueue_s == pytest.approx(2.5)
    assert clock.steal_s == pytest.approx(40 / os.sysconf("SC_CLK_TCK") / os.cpu_count())
    d = HostClock.read(schedstat=sched, stat=zeros) - clock
    assert d.steal_s is None and d.runqueue_s == 0.0 and d.cpu_s >= 0


def _thread(tasks, tid: int, name: str, on_cpu_ns: int | None) -> None:
    (tasks / str(tid)).mkdir(exist_ok=True)
    (tasks / str(tid) / "comm").write_text(name + "\n")
    if on_cpu_ns is not None:
        (tasks / str(tid) / "schedstat").write_text(f"{on_cpu_ns} 5 7\n")


def test_the_backward_clock_reads_its_own_devices_autograd_thread(tmp_path):
    """A CUDA backward's host side runs on autograd's pt_autograd_<index> thread while the loop thread sleeps:
    the clock reads the schedstat on-CPU time of its own device's thread, by exact name, not another device's;
    it looks again where its thread has ended. Before the thread exists, and for a CPU device, it is missing
    (None), not 0."""
    from zerotrain.metrics.meters import BackwardThreadClock, HostClock

    clock = BackwardThreadClock(torch.device("cuda", 1), tasks=tmp_path)
    assert clock.name == "pt_autograd_1" and clock.seconds() is None
    assert BackwardThreadClock(torch.device("cpu"), tasks=tmp_path).seconds() is None
    assert BackwardThreadClock(torch.device("cuda", 1), tasks=tmp_path / "absent").seconds() is None
    _thread(tmp_path, 10, "python3", 9_000_000_000)
    _thread(tmp_path, 11, "pt_autograd_0", 1_500_000_000)  # another GPU's
    _thread(tmp_path, 12, "pt_autograd_1", 250_000_000)
    _thread(tmp_path, 13, "pt_autograd_10", 700_000_000)  # a prefix match would take it
    start = HostClock.read(backward=clock)
    assert start.backward_cpu_s == pytest.approx(0.25)
    (tmp_path / "12" / "schedstat").write_text("1250000000 5 7\n")
    assert (HostClock.read(backward=clock) - start).backward_cpu_s == pytest.approx(1.0)
    (tmp_path / "12" / "schedstat").unlink()  # the thread ended (its comm still there); a new one took the name
    _thread(tmp_path, 14, "pt_autograd_1", 50_000_000)
    assert clock.seconds() == pytest.approx(0.05)
    assert BackwardThreadClock(torch.device("cpu"), tasks=tmp_path).seconds() is None


def test_a_backward_thread_born_inside_a_window_counts_from_its_start(tmp_path):
    """With no warm-up the meter starts before the first backward starts autograd's thread: the window's share
    counts that thread from 0, and the run's total keeps it, instead of losing it for the whole run."""
    from zerotrain.metrics.meters import BackwardThreadClock

    meter = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=0)
    meter._backward = BackwardThreadClock(torch.device("cuda", 0), tasks=tmp_path)  # a fake /proc
    meter.start()
    _thread(tmp_path, 21, "pt_autograd_0", 0)
    _spin_or_sleep(0.2, sleep=True)
    (tmp_path / "21" / "schedstat").write_text("100000000 5 7\n")  # 0.1 s on a CPU
    meter.add_step(micro_batches=1, samples=1, tokens=1)
    rates = meter.read()
    assert 0 < rates["host_backward_cpu_frac"] <= 0.1 / 0.2
    assert meter.summary()["host_backward_cpu_frac"] == pytest.approx(rates["host_backward_cpu_frac"])


def test_a_cpu_runs_meter_has_no_backward_share():
    """On a CPU the backward runs on the loop thread: no share (rather than a 0), whatever threads torch
    started for any GPU."""
    meter = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=0)
    meter.start()
    x = torch.ones(8, requires_grad=True)
    (x * 2).sum().backward()
    meter.add_step(micro_batches=1, samples=1, tokens=1)
    rates = meter.read()
    assert "host_cpu_frac" in rates and "host_backward_cpu_frac" not in rates
    assert "host_backward_cpu_frac" not in meter.summary()


def test_host_clock_readings_subtract_and_never_run_backwards():
    from zerotrain.metrics.meters import HostClock

    start = HostClock.read()
    _spin_or_sleep(0.05, sleep=False)
    d = HostClock.read() - start
    assert d.cpu_s > 0
    assert all(v is None or v >= 0 for v in (d.runqueue_s, d.steal_s, d.preemptions))


def test_compile_counters_name_the_graphs_a_run_compiled():
    from zerotrain.metrics.meters import compile_counters

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    for n in (2, 3):  # a new static shape: a second graph
        f(torch.ones(n))
    c = compile_counters()
    assert c["compile_unique_graphs"] == 2 and c["compile_frames"] == 2 and c["compile_graph_breaks"] == 0
    assert c["compile_cudagraph_skips"] == 0


def test_profile_summary_on_cpu(tmp_path):
    """The profile summary's format: per-step times, syncs, top operators, and its Markdown."""
    from zerotrain.metrics.meters import StepProfiler, kernel_family

    prof = StepProfiler(steps=2, start_after=1, device=torch.device("cpu"), out_dir=tmp_path, is_main=True)
    from torch.profiler import record_function

    x = torch.randn(64, 64)
    for step in range(1, 4):
        with record_function("zerotrain.forward"):  # as the engine names its phases
            (x @ x).relu().sum()
        prof.step(step)
    summary = json.loads((tmp_path / "profile.json").read_text())
    assert summary["steps"] == 2 and summary["wall_ms_per_step"] > 0 and summary["cpu_ms_per_step"] > 0
    assert list(summary["host_ms_per_step_by_phase"]) == ["forward"]
    assert 0 < summary["host_ms_per_step_by_phase"]["forward"] <= summary["wall_ms_per_step"]
    assert "| forward |" in (tmp_path / "profile.md").read_text()
    assert summary["gpu_ms_per_step"] == 0 and summary["syncs_per_step"] == 0
    assert any(t["name"] == "aten::mm" for t in summary["top"])
    assert (tmp_path / "profile.md").read_text().startswith("Profile of 2 steps")
    assert kernel_family("sm90_xmma_gemm_bf16bf16") == "matmul"
    assert kernel_family("flash_fwd_kernel") == "attention"
    assert kernel_family("multi_tensor_apply_kernel") == "optimizer"
    assert kernel_family("vectorized_layer_norm_kernel") == "norm/elementwise"


def test_profile_summary_keeps_phase_annotations_out_of_the_kernels():
    """On a GPU each named phase comes twice: the host range (CPU time) and a GPU-side annotation that
    spans the phase's kernels (device time, CPU time 0). The phase keeps its host time; the annotation
    is no kernel."""
    from types import SimpleNamespace

    from zerotrain.metrics.meters import summarize_profile

    from torch.autograd import DeviceType

    def event(key, cpu_us=0.0, device_us=0.0, count=1, gpu=False, annotation=False):
        return SimpleNamespace(key=key, cpu_time_total=cpu_us, self_cpu_time_total=cpu_us,
                               self_device_time_total=device_us, count=count, is_user_annotation=annotation,
                               device_type=DeviceType.CUDA if gpu else DeviceType.CPU)

    events = [event("zerotrain.forward", cpu_us=4000.0, annotation=True),
              event("zerotrain.forward", device_us=9000.0, gpu=True, annotation=True),
              event("sm90_xmma_gemm_bf16bf16", device_us=3000.0, gpu=True),
              event("cudaLaunchKernel", cpu_us=10.0, count=6)]
    s = summarize_profile(events, steps=2, wall_s=0.01)
    assert s["host_ms_per_step_by_phase"] == {"forward": 2.0}
    assert s["gpu_ms_per_step"] == 1.5 and [t["name"] for t in s["top"]] == ["sm90_xmma_gemm_bf16bf16"]
    assert s["kernel_launches_per_step"] == 3
    assert s["gpu_idle_ms_per_step"] == 3.5  # 5 ms a step of wall, 1.5 of it with a kernel running


def test_profile_summary_counts_a_kernel_once_though_its_launcher_has_its_name():
    """An inductor kernel is launched inside a host range of the same name, and a fused optimizer's
    kernels inside ``Optimizer.step#...``; the host ranges carry their kernels' device time, and counting
    them made GPU time exceed wall time (busy 104%, session 11)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from zerotrain.metrics.meters import summarize_profile

    def event(key, device_us, gpu):
        return SimpleNamespace(key=key, cpu_time_total=5.0, self_cpu_time_total=5.0, self_device_time_total=device_us,
                               count=12, is_user_annotation=False,
                               device_type=DeviceType.CUDA if gpu else DeviceType.CPU)

    events = [event("triton_poi_fused_gelu_backward_4", 1300.0, gpu=False),
              event("triton_poi_fused_gelu_backward_4", 1300.0, gpu=True),
              event("Optimizer.step#FusedAdam.step", 1400.0, gpu=False),
              event("multi_tensor_apply_kernel<AdamFunctor>", 1400.0, gpu=True)]
    s = summarize_profile(events, steps=1, wall_s=0.004)
    assert s["gpu_ms_per_step"] == 2.7
    assert s["gpu_ms_per_step_by_family"] == {"optimizer": 1.4, "norm/elementwise": 1.3}
    assert [t["name"] for t in s["top"]] == ["multi_tensor_apply_kernel<AdamFunctor>", "triton_poi_fused_gelu_backward_4"]


def test_profile_summary_keeps_collectives_apart_from_the_compute():
    """NCCL's kernels are named after their collective ("AllReduce"), which the elementwise family's
    "reduce" would claim; they run on their own stream and include the wait for the other ranks, so
    they are their own family and left out of the GPU's busy time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from zerotrain.metrics.meters import kernel_family, profile_markdown, summarize_profile

    def event(key, device_us):
        return SimpleNamespace(key=key, cpu_time_total=5.0, self_cpu_time_total=5.0, self_device_time_total=device_us,
                               count=1, is_user_annotation=False, device_type=DeviceType.CUDA)

    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    assert kernel_family(nccl) == "communication"
    s = summarize_profile([event(nccl, 2500.0), event("sm90_xmma_gemm_bf16bf16", 3000.0)], steps=1, wall_s=0.004)
    assert s["gpu_ms_per_step"] == 3.0 and s["comm_ms_per_step"] == 2.5
    assert s["gpu_idle_ms_per_step"] == 1.0
    assert s["gpu_ms_per_step_by_family"] == {"matmul": 3.0, "communication": 2.5}
    assert "Collectives (NCCL) 2.5 ms/step" in profile_markdown(s)


def test_host_peak_sees_memory_held_only_for_a_moment_inside_its_phase():
    import mmap

    from zerotrain.metrics.meters import HostPeak, host_rss_gib

    with HostPeak(interval_s=0.01) as peak:
        # 256 MiB of fresh pages, touched, then unmapped before the phase ends (a mapping of its own: an
        # allocator could serve a buffer from pages the process already holds, and the peak would not move)
        held = mmap.mmap(-1, 256 * 2**20)
        for offset in range(0, len(held), mmap.PAGESIZE):
            held[offset] = 1
        time.sleep(0.2)
        held.close()
    assert peak.peak_gib - peak.before_gib >= 0.2
    assert host_rss_gib() < peak.peak_gib  # the moment has passed; the phase's peak remembers it


class _Cycle:
    """An object in a reference cycle with itself: only the garbage collector frees it."""

    def __init__(self):
        self.me = self


def test_the_meter_counts_time_in_garbage_collections():
    """host_gc_ms_per_step: a step that makes the collector walk many objects reports its time, one that
    collects nothing reports next to none; the total over the run adds the windows."""
    import gc

    meter = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=0)
    meter.start()
    quiet = meter.read()  # an empty window: no steps, no rates
    assert quiet == {}
    meter.add_step(micro_batches=1, samples=1, tokens=1)
    calm = meter.read()
    gc.disable()  # no automatic collection while the garbage is made: the one below is all the window holds
    try:
        garbage = [_Cycle() for _ in range(300_000)]
        del garbage
    finally:
        gc.enable()
    start = time.perf_counter()
    gc.collect()  # walks and frees the 300k cycles: tens of ms on any machine
    took_ms = 1e3 * (time.perf_counter() - start)
    meter.add_step(micro_batches=1, samples=1, tokens=1)
    busy = meter.read()
    assert calm["host_gc_ms_per_step"] < 0.5 * took_ms
    assert 0.5 * took_ms <= busy["host_gc_ms_per_step"] <= took_ms + 1.0
    assert meter.summary()["host_gc_ms_per_step"] == pytest.approx(
        (calm["host_gc_ms_per_step"] + busy["host_gc_ms_per_step"]) / 2)
    watching = len(gc.callbacks)
    meter.close()
    assert len(gc.callbacks) == watching - 1  # closed, the meter no longer watches the collector


def test_the_gc_time_of_every_rank_is_added_in_the_counts_all_reduce():
    """gc_ms_per_step_all_ranks: this rank's collections plus the other ranks', carried in the all-reduce that
    adds the counts (here a stand-in where a second rank collected for 0.4 s); one process without that
    all-reduce reports its own, several without it report none rather than guess."""
    import gc

    other_rank = {"gc_s": 0.4, "samples": 1.0, "tokens": 1.0, "real_tokens": 1.0, "flops": 1.0}
    added = ThroughputMeter(torch.device("cpu"), 2, 1.0, "fp32", warmup_steps=0,
                            sum_across_ranks=lambda mine: {k: v + other_rank[k] for k, v in mine.items()})
    alone = ThroughputMeter(torch.device("cpu"), 1, 1.0, "fp32", warmup_steps=0)
    unsummed = ThroughputMeter(torch.device("cpu"), 2, 1.0, "fp32", warmup_steps=0)
    try:
        for meter in (added, alone, unsummed):
            meter.start()
            meter.add_step(micro_batches=1, samples=1, tokens=1)
            meter.add_step(micro_batches=1, samples=1, tokens=1)
        gc.collect()  # this rank's own collection, in every meter's window
        rates = {name: m.read() for name, m in (("added", added), ("alone", alone), ("unsummed", unsummed))}
    finally:
        for meter in (added, alone, unsummed):
            meter.close()
    own_ms = rates["added"]["host_gc_ms_per_step"]
    assert own_ms > 0
    assert rates["added"]["gc_ms_per_step_all_ranks"] == pytest.approx(own_ms + 1e3 * 0.4 / 2)
    assert rates["alone"]["gc_ms_per_step_all_ranks"] == pytest.approx(rates["alone"]["host_gc_ms_per_step"])
    assert "gc_ms_per_step_all_ranks" not in rates["unsummed"]
    assert added.summary()["gc_ms_per_step_all_ranks"] == pytest.approx(rates["added"]["gc_ms_per_step_all_ranks"])
