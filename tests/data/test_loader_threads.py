"""A loader that pins memory must not leave the training thread on one CPU core."""

from __future__ import annotations

import textwrap

import pytest
from helpers import run_python

# In a fresh process: the loader starts, then a thread does what PyTorch's pin-memory thread does first
# (``torch.set_num_threads(1)``); the training thread's count is read after its first batch.
_PROBE = textwrap.dedent("""
    import sys, threading, torch
    from torch.utils.data import DataLoader
    from zerotrain.data.loader import make_loader

    data = list(range(8))
    if sys.argv[1] == "zerotrain":
        loader = make_loader(data, [[0, 1], [2, 3]], torch.tensor, 1, 0)
        loader.pin_memory = True  # as on a GPU machine
    else:
        loader = DataLoader(data, batch_size=2, num_workers=1, pin_memory=True)
    batches = iter(loader)
    pin = threading.Thread(target=torch.set_num_threads, args=(1,))
    pin.start(); pin.join()
    next(batches)
    later = []  # a thread started after the first batch (autograd's, a checkpoint writer's)
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start(); thread.join()
    print("threads", torch.get_num_threads(), later[0])
    del batches
""")


@pytest.mark.slow
def test_a_pinning_loader_keeps_the_training_threads_cpu_threads(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)

    def threads(kind: str) -> tuple[int, int]:
        out = run_python([str(script), kind], cwd=tmp_path, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        training, later = out.stdout.split("threads")[-1].split()
        return int(training), int(later)

    default = int(run_python(["-c", "import torch; print(torch.get_num_threads())"], cwd=tmp_path).stdout)
    if default == 1:
        pytest.skip("PyTorch's default here is one thread (one physical core, or OMP_NUM_THREADS=1): nothing to tell apart")
    assert threads("torch") == (1, 1)  # the fault: PyTorch's own loader leaves the training thread one core
    assert threads("zerotrain") == (default, default)
