"""benchmarks/stack_shares.py: py-spy's raw stacks as shares of each thread, and of zerotrain's step phases."""

from __future__ import annotations

import importlib.util

from conftest import REPO

_spec = importlib.util.spec_from_file_location("stack_shares", REPO / "benchmarks" / "stack_shares.py")
stack_shares = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stack_shares)

STEP = "process 1:python;thread (0x1): MainThread;_train (/x/zerotrain/loop.py:143);train_step (/x/zerotrain/engine.py:115)"


def test_each_stack_of_the_loop_thread_falls_in_the_step_phase_train_step_called():
    from collections import Counter, defaultdict

    lines = [f"{STEP};DeepSpeedEngine._backward (/x/zerotrain/engine.py:304);backward (/t/_tensor.py:566) 6",
             f"{STEP};DeepSpeedEngine._optimizer_step (/x/zerotrain/engine.py:314);step (/d/stage_1_and_2.py:3013) 3",
             f"{STEP};forward (/x/zerotrain/models/sentiment.py:125) 2",
             f"{STEP} 1",  # train_step's own line
             "process 1:python;thread (0x1): MainThread;_train (/x/zerotrain/loop.py:150) 4",
             "process 1:python;thread (0x2): Dummy-3;backward (/t/graph.py:869) 5",
             # a train_step that is not zerotrain's engine's says nothing of the phase
             "process 1:python;thread (0x2): Dummy-3;train_step (/y/other.py:1);_backward (/y/other.py:2) 7"]
    phases = defaultdict(Counter)
    threads = stack_shares.shares(lines, phases)
    assert threads["MainThread"][0] == 16 and threads["Dummy-3"][0] == 12
    assert phases["MainThread"] == Counter({"backward": 6, "optimizer step": 3,
                                            "forward and the step's own lines": 3, "outside the step": 4})
    assert phases["Dummy-3"] == Counter({"outside the step": 12})
