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

Host side: a small model's step waits on the Python thread that launches its kernels, so the same
code can run at different speeds on a busier or slower host. For that thread (the loop's, which
starts and reads the meter) the meter reports, as shares of the wall time: the time it ran on a CPU
(``host_cpu_frac``: launching work, Python, and CUDA's waits for the GPU, which spin by default, so
a high share does not by itself mean the host sets the pace), the time it was ready to run but waited
for a CPU (``host_runqueue_frac``), and, for the whole machine, the CPU time a hypervisor took from
this virtual machine (``host_steal_frac``, averaged over CPUs). What remains the thread spent off the
CPU by its own choice: a lock, the GIL, a wait that sleeps. Also how often the kernel took the CPU
from it (``host_preemptions_per_step``). A reading the system does not give (no schedstat, a
``/proc/stat`` of zeros as under gVisor, not Linux) is left out, not reported as 0.

The loop thread does not run a CUDA backward's host side itself: ``loss.backward()`` hands it to
autograd's thread for that device (torch names it ``pt_autograd_<index>``) and sleeps until it is done.
That thread's time on a CPU is ``host_backward_cpu_frac`` (absent on a CPU run, whose backward runs on the
loop thread). The two threads take turns, so ``host_cpu_frac + host_backward_cpu_frac`` near 1 says the
host sets the step's pace; on IMDB preset (b) the backward was ~47% of the loop thread's wall time, which its
own clock showed only as sleep. And the
process's time in Python's garbage collections (``host_gc_ms_per_step``), which stop every Python
thread, the loop's included; and every rank's, added up (``gc_ms_per_step_all_ranks``): a long
collection on one rank holds every rank up at the step's next collective, though rank 0's own clocks
show only the wait.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import resource
import sys
import threading
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

from zerotrain.data.io import atomic_write_text, write_json

log = logging.getLogger("zerotrain")

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


class HostPeak:
    """Resident memory over one phase of a run (``with HostPeak() as peak: ...``): ``before_gib`` and
    ``peak_gib``, sampled every ``interval_s`` by a thread. The process's lifetime peak (``ru_maxrss``)
    cannot tell a phase at the end, such as the export, from the training before it."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s, self._stop = interval_s, threading.Event()
        self._thread = threading.Thread(target=self._sample, name="zerotrain-host-peak", daemon=True)
        self.before_gib = self.peak_gib = 0.0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_gib = max(self.peak_gib, host_rss_gib())

    def __enter__(self) -> "HostPeak":
        self.before_gib = self.peak_gib = host_rss_gib()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_gib = max(self.peak_gib, host_rss_gib())


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
    real_tokens: int = 0
    tokens: int = 0
    flops: float = 0.0
    data_wait_s: float = 0.0
    host: Optional["HostClock"] = None  # the loop thread's clocks over the window; None: not measured
    gc_s_all_ranks: Optional[float] = None  # every rank's garbage-collection time, added up; None: not measured


@dataclass(frozen=True)
class HostClock:
    """Cumulative clocks of the calling thread and the machine (module docstring): subtract two readings.
    None where the system does not keep that clock."""

    cpu_s: float
    runqueue_s: Optional[float]
    steal_s: Optional[float]  # per CPU
    preemptions: Optional[int]
    gc_s: Optional[float] = None  # the process's time in Python's garbage collections (every thread waits)
    backward_cpu_s: Optional[float] = None  # autograd's thread for the device, on a CPU (module docstring)

    @classmethod
    def read(cls, schedstat: Path = Path("/proc/thread-self/schedstat"), stat: Path = Path("/proc/stat"),
             backward: Optional["BackwardThreadClock"] = None) -> "HostClock":
        runqueue = _runqueue_s(schedstat)
        try:
            r = resource.getrusage(resource.RUSAGE_THREAD)
            cpu = r.ru_utime + r.ru_stime
            # Without schedstat the kernel is not Linux's own (gVisor leaves the switch counts at 0 too)
            preemptions: Optional[int] = r.ru_nivcsw if runqueue is not None else None
        except (AttributeError, OSError):
            cpu, preemptions = time.thread_time(), None
        return cls(cpu, runqueue, _steal_s(stat), preemptions, _GC_TIME.seconds(),
                   backward.seconds() if backward is not None else None)

    def __sub__(self, start: "HostClock") -> "HostClock":
        return self._combine(start, lambda a, b: a - b)

    def __add__(self, other: "HostClock") -> "HostClock":
        return self._combine(other, lambda a, b: a + b)

    def _combine(self, other: "HostClock", op: Callable) -> "HostClock":
        """Field by field; a clock one side lacks is lacking in the result."""
        values = [None if a is None or b is None else op(a, b) for a, b in zip(astuple(self), astuple(other))]
        return HostClock(*values)


class _GcTime:
    """Seconds spent in Python's garbage collections while a callback in ``gc.callbacks`` watches: registered at
    the first :meth:`seconds` call (a process that never reads the clock pays nothing), removed by :meth:`stop`
    (a fit leaves the process as it found it). A collection holds the GIL, so it stops every Python thread of
    the process, the training loop's included."""

    def __init__(self) -> None:
        self._total = 0.0
        self._began: Optional[float] = None
        self._installed = False

    def seconds(self) -> float:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self._total

    def stop(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed, self._began = False, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self._total += time.perf_counter() - self._began
            self._began = None


_GC_TIME = _GcTime()


def _runqueue_s(path: Path) -> Optional[float]:
    """Seconds this thread was runnable but not running (the second field of Linux's schedstat)."""
    try:
        return int(path.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class BackwardThreadClock:
    """Seconds on a CPU of autograd's thread for one CUDA device, which torch names ``pt_autograd_<index>``
    (the first field of its schedstat); None for a CPU device, before the first backward starts the thread,
    or without /proc. The name is matched exactly: torch starts one such thread for every visible GPU at the
    first backward, CPU or CUDA, and the meter reads its own device's. (A thread started from it would inherit
    the name; the first one found is read.)"""

    def __init__(self, device: torch.device, tasks: Path = Path("/proc/self/task")):
        index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
        self.name = f"pt_autograd_{index}" if device.type == "cuda" else None
        self._tasks, self._thread = tasks, None  # the thread's /proc folder, once found

    def seconds(self) -> Optional[float]:
        if self.name is None:
            return None
        for _ in range(2):  # the cached folder, then a fresh look where that thread has ended
            if self._thread is None:
                self._thread = self._find()
                if self._thread is None:
                    return None
            try:
                return int((self._thread / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, IndexError, ValueError):
                self._thread = None
        return None

    def _find(self) -> Optional[Path]:
        try:
            threads = list(self._tasks.iterdir())
        except OSError:
            return None
        for thread in threads:
            try:
                if (thread / "comm").read_text().strip() == self.name:
                    int((thread / "schedstat").read_text().split()[0])  # a thread that has ended reads no more
                    return thread
            except (OSError, IndexError, ValueError):  # a thread that ended between the listing and the read
                continue
        return None


def _steal_s(path: Path) -> Optional[float]:
    """Seconds a hypervisor ran something else on this machine's CPUs, per CPU (/proc/stat's steal); None
    where the file is missing or all zeros (gVisor), which would read as "no steal"."""
    try:
        fields_ = [int(x) for x in path.read_text().split("\n", 1)[0].split()[1:]]
        if not any(fields_):
            return None
        return fields_[7] / os.sysconf("SC_CLK_TCK") / (os.cpu_count() or 1)
    except (OSError, IndexError, ValueError):
        return None


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
        self._backward = BackwardThreadClock(device)
        self._clock0, self._thread = self._host_clock(), threading.get_ident()
        self.total = Window(host=HostClock(0.0, 0.0, 0.0, 0, 0.0, 0.0), gc_s_all_ranks=0.0)
        self.total_seconds = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()
        self._clock0, self._thread = self._host_clock(), threading.get_ident()
        self.window = Window()

    def _host_clock(self) -> HostClock:
        return HostClock.read(backward=self._backward)

    def add_data_wait(self, seconds: float) -> None:
        self.window.data_wait_s += seconds

    def add_step(self, micro_batches: int, samples: int, tokens: int, flops: Optional[float] = None,
                 real_tokens: Optional[int] = None) -> None:
        """Count one optimizer step's work. Steps in the warm-up restart the clock instead.

        ``tokens`` are the positions the model computed (padding included: they cost FLOPs);
        ``real_tokens`` the non-padding ones (what a user's data holds; default ``tokens``).
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
        w.real_tokens += tokens if real_tokens is None else real_tokens
        w.flops += flops if flops is not None else self.flops_per_token * tokens

    def read(self) -> dict[str, float]:
        """Rates for the window since the last read, then start a new window. Empty during warm-up."""
        synchronize(self.device)
        now = time.perf_counter()
        clock = self._host_clock()
        w = self.window
        start = self._clock0
        if clock.backward_cpu_s is not None and (start.backward_cpu_s is None or clock.backward_cpu_s < start.backward_cpu_s):
            # Autograd's thread started in this window (the first backward), or a new one replaced it: its clock
            # counts from its own start
            start = dataclasses.replace(start, backward_cpu_s=0.0)
        # Thread clocks compare only within one thread: read from another, the window has none
        w.host = clock - start if threading.get_ident() == self._thread else None
        ws = self.world_size
        counts = {"samples": float(w.samples), "tokens": float(w.tokens), "real_tokens": float(w.real_tokens),
                  "flops": w.flops}
        # Process-wide (any thread may read it); carried in the same all-reduce as the counts, by every rank
        gc_s = (clock.gc_s or 0.0) - (self._clock0.gc_s or 0.0)
        if self._sum:
            job = self._sum({**counts, "gc_s": gc_s})
            w.gc_s_all_ranks = job["gc_s"]
        else:
            job = {k: v * ws for k, v in counts.items()}
            w.gc_s_all_ranks = gc_s if ws == 1 else None  # the other ranks' collections are not this rank's
        w.samples, w.tokens, w.real_tokens = int(job["samples"]), int(job["tokens"]), int(job["real_tokens"])
        w.flops = job["flops"]
        out: dict[str, float] = {}
        if self._t0 is not None and w.steps > 0:
            elapsed = now - self._t0
            out = self._rates(w, elapsed)
            for f in fields(Window):
                a, b = getattr(self.total, f.name), getattr(w, f.name)
                setattr(self.total, f.name, None if a is None or b is None else a + b)
            self.total_seconds += elapsed
        self._t0, self._clock0 = now, clock
        self.window = Window()
        return out

    def close(self) -> None:
        """Stop watching the garbage collector (the clocks read after this lack ``gc_s``'s later collections)."""
        _GC_TIME.stop()

    def summary(self) -> dict[str, float]:
        """Rates over the whole run after warm-up (what a benchmark reports)."""
        t, s = self.total, self.total_seconds
        if not t.steps or s <= 0:
            return {}
        return {**self._rates(t, s), "measured_steps": t.steps}

    def _rates(self, w: Window, seconds: float) -> dict[str, float]:
        """A window's counts as rates over ``seconds`` of wall time (samples and tokens job-wide, TFLOP/s per
        GPU)."""
        out = {
            "sec_per_step": seconds / w.steps,
            "sec_per_batch": seconds / w.micro_batches,
            "samples_per_s": w.samples / seconds,
            "tokens_per_s": w.tokens / seconds,
            "real_tokens_per_s": w.real_tokens / seconds,
            "tflops_per_gpu": w.flops / self.world_size / seconds / 1e12,
            "data_wait_frac": min(1.0, w.data_wait_s / seconds),
        }
        h = w.host
        if h is not None:
            shares = {"host_cpu_frac": h.cpu_s, "host_runqueue_frac": h.runqueue_s, "host_steal_frac": h.steal_s,
                      "host_backward_cpu_frac": h.backward_cpu_s}
            out.update({k: v / seconds for k, v in shares.items() if v is not None})
            if h.preemptions is not None:
                out["host_preemptions_per_step"] = h.preemptions / w.steps
            if h.gc_s is not None:
                out["host_gc_ms_per_step"] = 1e3 * h.gc_s / w.steps
        if w.gc_s_all_ranks is not None:
            out["gc_ms_per_step_all_ranks"] = 1e3 * w.gc_s_all_ranks / w.steps
        if self.peak:
            out["mfu"] = out["tflops_per_gpu"] / self.peak
        return out


def compile_counters() -> dict[str, int]:
    """What ``torch.compile`` did in this process, for a run's summary (empty when nothing was compiled): a
    row that recompiled, broke its graph or fell back from CUDA graphs to eager launches says so here
    instead of only being slower."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    if not counters["frames"]["total"]:
        return {}
    inductor = counters["inductor"]
    return {"compile_frames": counters["frames"]["ok"], "compile_unique_graphs": counters["stats"]["unique_graphs"],
            "compile_graph_breaks": sum(counters["graph_break"].values()),
            "compile_cudagraph_skips": inductor["cudagraph_skips"],
            "compile_fxgraph_cache_hits": inductor["fxgraph_cache_hit"],
            "compile_fxgraph_cache_misses": inductor["fxgraph_cache_miss"]}


def memory_snapshot(device: torch.device) -> dict[str, float]:
    return {"host_rss_gib": host_rss_gib(), "host_rss_peak_gib": host_peak_rss_gib(), **gpu_memory_gib(device)}


# Kernel families for the profile summary, matched on lower-cased kernel names, first match wins.
KERNEL_FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    # First: NCCL's kernels are named after their collective ("...AllReduce_Sum_bf16...")
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "wgmma")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("norm/elementwise", ("norm", "elementwise", "vectorized", "reduce", "softmax", "gelu", "dropout",
                          "copy", "fill", "cat", "index", "scatter", "gather", "where", "embedding")),
]
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")


class StepProfiler:
    """torch.profiler over ``steps`` optimizer steps once the warm-up is over; a short summary per run.

    Writes ``<run>/profile.json`` and ``profile.md``: wall, CPU and GPU time per step, the GPU's busy
    fraction (the compute kernels'; the rest is the device waiting for the host, a copy or a
    collective), host-device synchronisations per step, GPU time per kernel family (communication,
    attention, matmul, optimizer, norm/elementwise, other) and the top kernels (on a CPU run: the top
    operators by CPU time).
    """

    def __init__(self, steps: int, start_after: int, device: torch.device, out_dir: Path, is_main: bool):
        self.steps, self.start_after, self.device = steps, start_after, device
        self.out_dir, self.is_main = out_dir, is_main
        self._prof = None
        self._t0 = 0.0

    def close(self) -> None:
        """Stop a profiler still recording (the run ended, or failed, inside the profiled steps), without a summary.

        A profiler left running when the process exits crashes it in torch's profiler library (exit 139, after
        the run's last line), so the loop closes it however the run ends."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def step(self, step: int, last_step: Optional[int] = None) -> bool:
        """Call after each optimizer step. True when profiling started or stopped at this step: the
        profiler slows the steps it records, so the caller restarts its throughput clock. ``last_step``: the
        run's last; profiling that would not end by then does not start (a warning says so)."""
        if not self.steps:
            return False
        if self._prof is None and step == self.start_after and last_step is not None \
                and step + self.steps > last_step:
            if self.is_main:
                log.warning("--trainer.profile_steps %d: the run ends at step %d, before %d steps after the warm-up "
                            "(step %d) could be profiled; no profile written (train longer or profile fewer steps)",
                            self.steps, last_step, self.steps, step)
            self.steps = 0
            return False
        if self._prof is None and step == self.start_after:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities)
            synchronize(self.device)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
            return True
        if self._prof is not None and step == self.start_after + self.steps:
            synchronize(self.device)
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            summary = summarize_profile(self._prof.key_averages(), self.steps, wall)
            self._prof, self.steps = None, 0
            if self.is_main:

                write_json(self.out_dir / "profile.json", summary)
                atomic_write_text(self.out_dir / "profile.md", profile_markdown(summary))
            return True
        return False


def _device_us(event) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0)


def _is_kernel(event) -> bool:
    """A GPU kernel's own entry. Host-side events carry device time too, the summed time of the kernels
    they launched: an inductor kernel's launcher range and a fused optimizer's ``Optimizer.step#...``
    range repeat the kernel under its own name, and counting them would count those kernels twice.
    The engine's named phases also have a GPU-side annotation that spans their kernels; it is no kernel."""
    from torch.autograd import DeviceType

    return (getattr(event, "device_type", None) == DeviceType.CUDA and _device_us(event) > 0
            and not getattr(event, "is_user_annotation", False)
            and not event.key.startswith(("Memcpy", "Memset", "zerotrain.")))


def summarize_profile(events, steps: int, wall_s: float) -> dict:
    """The numbers of :class:`StepProfiler`'s summary from ``profile.key_averages()`` (times in ms per step)."""
    kernels = [e for e in events if _is_kernel(e)]
    # A collective's kernel time includes waiting for the other ranks, and it may run on a stream beside the
    # compute: it is reported apart, and the GPU's busy and idle time are the compute kernels'.
    compute = [e for e in kernels if kernel_family(e.key) != "communication"]
    comm = [e for e in kernels if kernel_family(e.key) == "communication"]
    gpu_ms = sum(_device_us(e) for e in compute) / 1e3 / steps
    comm_ms = sum(_device_us(e) for e in comm) / 1e3 / steps
    families: dict[str, float] = {}
    for e in kernels:
        fam = kernel_family(e.key)
        families[fam] = families.get(fam, 0.0) + _device_us(e) / 1e3 / steps
    ops = [e for e in events if e.key.startswith("aten::")]
    top = (sorted(kernels, key=_device_us, reverse=True) if kernels
           else sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True))[:20]
    # Inclusive host time of the engine's named phases (zerotrain.forward, .backward, .optimizer_step)
    phases: dict[str, float] = {}
    for e in events:
        if e.key.startswith("zerotrain.") and e.cpu_time_total > 0:
            name = e.key.removeprefix("zerotrain.")
            phases[name] = phases.get(name, 0.0) + e.cpu_time_total / 1e3 / steps
    launches = sum(e.count for e in events if e.key in LAUNCH_CALLS)
    syncs = sum(e.count for e in events if e.key in SYNC_CALLS)
    reads = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
    wall_ms = wall_s * 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "cpu_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
        "gpu_ms_per_step": gpu_ms,
        "comm_ms_per_step": comm_ms,
        "gpu_busy_frac": gpu_ms / wall_ms if wall_ms else 0.0,
        # Wall time with no compute kernel running (kernels on two streams can overlap, so a lower bound)
        "gpu_idle_ms_per_step": max(wall_ms - gpu_ms, 0.0) if compute else 0.0,
        "host_ms_per_step_by_phase": phases,
        "kernel_launches_per_step": launches / steps,
        "syncs_per_step": syncs / steps,
        "device_reads_per_step": reads / steps,
        "gpu_ms_per_step_by_family": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "top": [{"name": e.key[:90], "calls_per_step": e.count / steps,
                 "ms_per_step": (_device_us(e) if kernels else e.self_cpu_time_total) / 1e3 / steps,
                 "family": kernel_family(e.key) if kernels else "cpu op"} for e in top],
    }


def profile_markdown(s: dict) -> str:
    lines = [f"Profile of {s['steps']} steps: {s['wall_ms_per_step']:.1f} ms/step wall, "
             f"{s['cpu_ms_per_step']:.1f} ms CPU, {s['gpu_ms_per_step']:.1f} ms GPU "
             f"(busy {s['gpu_busy_frac']:.0%}), {s['syncs_per_step']:.1f} host-device syncs and "
             f"{s['device_reads_per_step']:.1f} device-value reads per step.", ""]
    if s.get("kernel_launches_per_step"):
        lines[0] += f" {s['kernel_launches_per_step']:.0f} kernel launches per step."
    if s.get("comm_ms_per_step"):
        lines[0] += (f" Collectives (NCCL) {s['comm_ms_per_step']:.1f} ms/step, waits for other ranks included,"
                     " not counted in GPU time.")
    if s.get("host_ms_per_step_by_phase"):
        lines += ["| phase (host, inclusive) | CPU ms/step |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in s["host_ms_per_step_by_phase"].items()] + [""]
    if s["gpu_ms_per_step_by_family"]:
        lines += ["| kernel family | GPU ms/step |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in s["gpu_ms_per_step_by_family"].items()]
        lines += [f"| (no compute kernel running: the GPU waits for the host, a copy or a collective) | "
                  f"{s.get('gpu_idle_ms_per_step', 0.0):.2f} |", ""]
    lines += ["| top | family | calls/step | ms/step |", "|---|---|---|---|"]
    lines += [f"| `{t['name']}` | {t['family']} | {t['calls_per_step']:.1f} | {t['ms_per_step']:.3f} |" for t in s["top"]]
    return "\n".join(lines) + "\n"
