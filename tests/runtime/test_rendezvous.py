"""The rendezvous has a bounded wait that says what it waits for, and stops on SIGTERM (fresh processes, CPU).

Real sockets: a port nobody listens on, an address no interface of this machine has, a name that resolves nowhere.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import start_zerotrain, zerotrain_cmd


def fit_args(tmp_path: Path, timeout_minutes: float) -> list[str]:
    return ["fit", "toy", "--trainer.max_steps", "1", "--trainer.device", "cpu", "--trainer.num_workers", "0",
            "--logging.progress_bar", "false", "--trainer.output_dir", str(tmp_path / "runs"),
            "--launch.rdzv_timeout_minutes", str(timeout_minutes)]


def rank_env(rank: int, addr: str, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def unused_port() -> int:
    from zerotrain.runtime.distributed import free_port

    return free_port()  # nothing listens there once the probe socket is closed


@pytest.mark.slow
def test_a_rank_that_reaches_no_rendezvous_gives_up_in_one_line(tmp_path):
    port = unused_port()
    out = zerotrain_cmd(fit_args(tmp_path, 0.05), tmp_path, **rank_env(1, "127.0.0.1", port))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-2000:]
    assert lines == [f"[zerotrain] rank 1: waiting up to 0.05 minutes for rank 0's rendezvous at MASTER_ADDR:MASTER_PORT "
                     f"127.0.0.1:{port}",
                     f"zerotrain fit: error: rank 1: nothing answers at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} after "
                     "0.05 minutes (--launch.rdzv_timeout_minutes): start rank 0, or set MASTER_ADDR (or "
                     "--launch.rdzv_endpoint) to the address of its node"]


@pytest.mark.slow
@pytest.mark.parametrize("addr,message", [
    ("192.0.2.1", "192.0.2.1 is not an address of this machine, and rank 0 serves the rendezvous there"),  # TEST-NET-1
    ("no-such-host.invalid", "'no-such-host.invalid' is not a host name or address this machine can resolve"),
])
def test_rank_0_with_a_wrong_master_addr_stops_at_once(tmp_path, addr, message):
    out = zerotrain_cmd(fit_args(tmp_path, 10), tmp_path, **rank_env(0, addr, 29987))
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
def test_sigterm_ends_the_wait_for_the_rendezvous(tmp_path):
    job = start_zerotrain(fit_args(tmp_path, 10), tmp_path, **rank_env(1, "127.0.0.1", unused_port()))
    try:
        deadline = time.monotonic() + 300  # importing torch and DeepSpeed, on a loaded machine
        while "waiting up to 10 minutes" not in (tmp_path / "stderr.txt").read_text():
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-2000:]
            time.sleep(0.5)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
