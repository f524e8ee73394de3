"""Who starts the processes (torchrun, srun, or zerotrain itself) and the Hopper arch-list fix."""

from __future__ import annotations

import os
import re

import pytest

from zerotrain.config import LaunchConfig
from zerotrain.runtime.launcher import (
    adopt_slurm_env,
    few_threads_line,
    launched_by_a_launcher,
    sanitize_cuda_arch_list,
    threads_per_worker,
)

CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
         "SLURM_NNODES", "SLURM_LOCALID")


@pytest.fixture()
def env(monkeypatch):
    # adopt_slurm_env writes os.environ directly: restore it whole, or RANK=5 of 8 would leak into
    # the next test's process group and make it wait for seven ranks that never come.
    saved = dict(os.environ)
    for key in CLEAN:
        monkeypatch.delenv(key, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_torchrun_worker_is_launched(env):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "8")  # torchrun sets both; RANK alone is refused (check_launcher_env)
    assert launched_by_a_launcher(LaunchConfig(nproc_per_node=8))


def test_one_srun_task_per_node_is_a_launcher(env):
    """--ntasks-per-node=1 with --launch.nproc_per_node 8: zerotrain starts the 8 workers itself."""
    env.setenv("SLURM_PROCID", "1")
    env.setenv("SLURM_NTASKS", "2")
    env.setenv("SLURM_NNODES", "2")
    launch = LaunchConfig(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert not launched_by_a_launcher(launch)
    adopt_slurm_env(launch)
    assert "RANK" not in os.environ


def test_one_srun_task_per_gpu_is_a_rank(env):
    env.setenv("SLURM_PROCID", "5")
    env.setenv("SLURM_NTASKS", "8")
    env.setenv("SLURM_NNODES", "2")
    env.setenv("SLURM_LOCALID", "1")
    launch = LaunchConfig(rdzv_endpoint="node0:29511")
    assert launched_by_a_launcher(launch)
    adopt_slurm_env(launch)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node0", "29511")


@pytest.mark.parametrize("given,fixed", [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("9.0a 10.0a", "9.0;10.0")])
def test_arch_list_suffixes_are_removed(env, given, fixed):
    env.setenv("TORCH_CUDA_ARCH_LIST", given)
    assert sanitize_cuda_arch_list() == given
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == fixed


def test_plain_arch_list_is_left_alone(env):
    env.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert sanitize_cuda_arch_list() is None and os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"


@pytest.mark.parametrize("variables, words", [
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT='0'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "SLURM_NTASKS='0'"),
])
def test_launcher_env_that_describes_no_job_is_refused(env, variables, words):
    from zerotrain.errors import UserError
    from zerotrain.runtime.launcher import check_launcher_env

    for name, value in variables.items():
        env.setenv(name, value)
    with pytest.raises(UserError, match=re.escape(words)):
        check_launcher_env()


def test_launcher_env_of_a_real_job_passes(env):
    from zerotrain.runtime.launcher import check_launcher_env

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "65535"}.items():
        env.setenv(name, value)
    check_launcher_env()  # raises nothing
    assert launched_by_a_launcher(LaunchConfig())


def test_each_worker_gets_its_share_of_the_physical_cores(monkeypatch):
    """The cores this process may run on, two hardware threads to a core, shared out: not torchrun's 1 a worker,
    which would leave DeepSpeed's CPU Adam on one core per GPU."""
    import psutil

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 64 if logical else 32)
    assert [threads_per_worker(n) for n in (1, 2, 4, 8, 32)] == [16, 8, 4, 2, 1]
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 32)  # no hardware threads
    assert [threads_per_worker(n) for n in (1, 3, 64)] == [32, 10, 1]


def test_one_thread_for_a_host_optimizer_is_said_with_the_share_to_set(monkeypatch):
    import psutil
    import torch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert few_threads_line(True) == (
        "the optimizer steps on the host with 1 CPU thread in each process (OMP_NUM_THREADS=1), and this node has 4 "
        "cores for each: set OMP_NUM_THREADS=4 in the launcher's environment (Ray: resources_per_worker CPU)")
    assert few_threads_line(False) is None  # the optimizer on the GPU: the threads hardly matter
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert few_threads_line(True) is None  # one core each: nothing to spare
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert few_threads_line(True) is None
