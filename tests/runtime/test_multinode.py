"""Several nodes, simulated by several launchers on one machine: the path `--launch.nnodes` takes, run in CI.

Each launcher is what one node runs (`zerotrain fit ... --launch.nnodes 2 --launch.node_rank R`); they meet
at one rendezvous endpoint over Gloo on CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import LAUNCHER_VARS, REPO, train_log, zerotrain_cmd

from zerotrain.runtime.distributed import free_port

FIT = ["fit", "toy", "--trainer.max_steps", "4", "--trainer.log_every_steps", "1", "--trainer.num_workers", "0",
       "--trainer.device", "cpu", "--strategy.zero_stage", "2", "--logging.progress_bar", "false",
       "--logging.tensorboard", "false"]


def _launcher(args: list[str], cwd) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "zerotrain", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow  # three launchers, four worker processes
def test_two_nodes_of_one_process_train_like_one_node_of_two(tmp_path):
    one = zerotrain_cmd([*FIT, "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "one_node",
                         "--launch.nproc_per_node", "2"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [_launcher([*FIT, "--trainer.output_dir", str(tmp_path), "--trainer.run_name", "two_nodes",
                        "--launch.nnodes", "2", "--launch.node_rank", str(rank), "--launch.rdzv_endpoint", endpoint],
                       tmp_path) for rank in (0, 1)]
    outs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-3000:]
    # Each launcher says once what it waits for.
    for rank, (_, err) in enumerate(outs):
        assert err.splitlines()[0] == (f"zerotrain: node {rank} of 2: waiting up to 10 min (--launch.rdzv_timeout_minutes) "
                                       f"for all 2 nodes to join at {endpoint} (Ctrl-C stops)")

    a, b = train_log(tmp_path / "one_node"), train_log(tmp_path / "two_nodes")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [a[s]["train_loss"] for s in a] == [b[s]["train_loss"] for s in a]


@pytest.mark.slow
def test_a_node_alone_gives_up_after_the_rendezvous_timeout_with_one_line(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    out = zerotrain_cmd([*FIT, "--trainer.output_dir", str(tmp_path), "--launch.nnodes", "2", "--launch.node_rank", "0",
                         "--launch.rdzv_endpoint", endpoint, "--launch.rdzv_timeout_minutes", "0.1"], cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"zerotrain: node 0 of 2: waiting up to 0.1 min (--launch.rdzv_timeout_minutes) for all 2 nodes to join at "
        f"{endpoint} (Ctrl-C stops)",
        f"zerotrain: node 0: not all 2 nodes joined at {endpoint} within 0.1 min (--launch.rdzv_timeout_minutes): "
        "start the same command with --launch.node_rank 0..1 on every node, and check that this node reaches that "
        "address (DistStoreError)",
    ]


@pytest.mark.slow
def test_ctrl_c_stops_a_node_waiting_for_the_others(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    node = _launcher([*FIT, "--trainer.output_dir", str(tmp_path), "--launch.nnodes", "2", "--launch.node_rank", "0",
                      "--launch.rdzv_endpoint", endpoint], tmp_path)
    first = node.stderr.readline()  # printed just before the wait begins
    assert first.startswith("zerotrain: node 0 of 2: waiting up to 10 min")
    node.send_signal(signal.SIGINT)
    # A hang here fails the test through the timeout (the rendezvous itself would wait 10 minutes).
    # Killed by the signal during the wait (SIG_DFL), or, when it lands while Python still starts up, the
    # CLI's own KeyboardInterrupt exit (130): either way the launcher has stopped.
    assert node.wait(timeout=60) in (-signal.SIGINT, 130)


def test_launcher_passes_only_the_torchrun_flags_this_torch_has(monkeypatch):
    """torch 2.11's torchrun has --signals-to-handle but not --shutdown-timeout: a flag it lacks would
    stop every multi-process launch with "unrecognized arguments"."""
    import argparse

    import torch.distributed.run as torchrun

    from zerotrain.config import LaunchConfig
    from zerotrain.runtime.launcher import torchrun_arguments

    real = torchrun.get_args_parser

    def without_shutdown_timeout() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        for action in real()._actions:
            if action.option_strings and "--shutdown-timeout" not in action.option_strings and action.dest != "help":
                parser._add_action(action)
            elif not action.option_strings:
                parser._add_action(action)
        return parser

    assert vars(torchrun_arguments(LaunchConfig(nproc_per_node=2), ["fit", "toy"]))["shutdown_timeout"] == 600
    monkeypatch.setattr(torchrun, "get_args_parser", without_shutdown_timeout)
    seen = vars(torchrun_arguments(LaunchConfig(nproc_per_node=2), ["fit", "toy", "--trainer.max_steps", "3"]))
    assert seen["nproc_per_node"] == "2" and "shutdown_timeout" not in seen
    assert "SIGUSR1" in seen["signals_to_handle"]
    assert (seen["module"], seen["training_script"], seen["training_script_args"]) == (
        True, "zerotrain", ["fit", "toy", "--trainer.max_steps", "3"])
