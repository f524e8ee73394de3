"""The sbatch script ``zerotrain launch --emit slurm`` writes, run by a real one-node SLURM that the test starts.

Where SLURM's daemons (Debian's ``slurm-wlm``) and ``munge`` are installed and the test runs as root, a fixture
writes a slurm.conf for this machine as one node (its own ports, state and spool folders, a MUNGE key and socket
of its own, no accounting, no cgroups), starts munged, slurmctld and slurmd, and stops them after the module.
Jobs run the toy recipe as 2 tasks (2 ranks over Gloo), as the template runs any command.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import child_env, zerotrain_cmd
from safetensors.torch import load_file

from zerotrain.checkpoint.layout import complete_checkpoints, read_marker
from zerotrain.runtime.distributed import free_port
from zerotrain.runtime.preemption import PREEMPTED_EXIT

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo", "srun")

# Plain DDP: what is tested is the scheduler's side (signals, requeue, resume), the same for every engine, and a
# DeepSpeed CPU run may first build its communication op for minutes (tests/runtime/test_preemption.py resumes
# DeepSpeed after a signal).
FIT = ["fit", "toy", "--strategy.backend", "ddp", "--trainer.device", "cpu", "--launch.nproc_per_node", "2",
       "--data.num_examples", "64",
       "--trainer.micro_batch_size", "4", "--checkpoint.every_steps", "10", "--trainer.log_every_steps", "10",
       "--trainer.evaluate", "false", "--trainer.num_workers", "0", "--logging.progress_bar", "false",
       "--logging.tensorboard", "false", "--launch.timeout_minutes", "5"]
STEPS = 100

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def _missing() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


SLURM_CONF = """\
ClusterName=zerotrain-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={dir}/munge.socket,cred_expire=5
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# Look at pending jobs every second (default 60 s): a requeued job starts again within seconds.
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A one-node SLURM in ``folder``: its daemons, and the client commands pointed at it (``SLURM_CONF``)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.logs = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self) -> None:
        d = self.folder
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        (d / "munge.key").write_bytes(os.urandom(1024))
        (d / "munge.key").chmod(0o400)
        self.conf.write_text(SLURM_CONF.format(dir=d, ctld_port=free_port(), d_port=free_port(),
                                               cpus=max(2, os.cpu_count() or 1)))
        logs = self.logs = open(d / "daemons.log", "w")  # noqa: SIM115 (the daemons write it until stop())
        self.daemons.append(subprocess.Popen(
            [_exe("munged"), "--foreground", "--force", f"--key-file={d}/munge.key", f"--socket={d}/munge.socket",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed"],
            stdout=logs, stderr=subprocess.STDOUT))
        self._wait(lambda: (d / "munge.socket").exists(), "munged to create its socket")
        for daemon in ("slurmctld", "slurmd"):
            self.daemons.append(subprocess.Popen([_exe(daemon), "-D", "-f", str(self.conf)], env=self.env(),
                                                 stdout=logs, stderr=subprocess.STDOUT))
        self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False).stdout,
                   "the node to be idle in sinfo")

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if ready():
                return
            dead = [p.args[0] for p in self.daemons if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        logs = "".join(p.read_text()[-1500:] for p in sorted(self.folder.glob("*.log")))
        raise RuntimeError(f"SLURM did not start (waiting for {what}; exited: {dead}): {logs}")

    def run(self, *args: str, check: bool = True, **env_extra: str) -> subprocess.CompletedProcess:
        env = self.env()
        env.update(env_extra)
        out = subprocess.run([_exe(args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=60,
                             cwd=self.folder, check=False)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out

    def sbatch(self, script: Path, *options: str) -> str:
        # The job's environment is this one's (sbatch exports it): this checkout's src/ first on PYTHONPATH.
        env = child_env(["sbatch"], {"SLURM_CONF": str(self.conf)})
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        out = subprocess.run([_exe("sbatch"), "--parsable", *options, str(script)], env=env, capture_output=True,
                             text=True, timeout=60, cwd=script.parent, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_ended(self, job_id: str, timeout: float = 600) -> dict[str, str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            job = self.job(job_id)
            if job.get("JobState") in ENDED:
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not end within {timeout} s: {self.job(job_id)}")

    def stop(self) -> None:
        """Cancel the jobs and wait for them while every daemon still runs (a job step needs munged to report its
        end), then stop slurmd, slurmctld and munged, one after the other; then end what this cluster started and
        outlived them (``slurmstepd`` and its tasks are re-parented to init): the processes whose ``SLURM_CONF``
        is this cluster's."""
        if all(p.poll() is None for p in self.daemons) and len(self.daemons) == len(DAEMONS):
            self.run("scancel", "--full", "--user", "root", check=False)
            end = time.monotonic() + 60
            while time.monotonic() < end and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue
        if self.logs is not None:
            self.logs.close()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = _missing()
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld, slurmd and munged for a test needs root")
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _script(tmp_path: Path, name: str, steps: int) -> Path:
    out = tmp_path / f"{name}.sbatch"
    emitted = zerotrain_cmd(["launch", "--emit", "slurm", "--out", str(out), "--job_name", name, "--shared_dir",
                             str(tmp_path / "runs"), "--exe", f"{sys.executable} -m zerotrain", "--",
                             *FIT, "--trainer.max_steps", str(steps)], cwd=tmp_path)
    assert emitted.returncode == 0, emitted.stderr
    return out


def _run_dir(tmp_path: Path, name: str, job_id: str) -> Path:
    return tmp_path / "runs" / f"{name}-{job_id}"  # the template's run name: JOBNAME-JOBID


def _wait_for_checkpoint(slurm: Slurm, job_id: str, run_dir: Path, timeout: float = 480) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if complete_checkpoints(run_dir / "checkpoints"):
            return
        if slurm.job(job_id).get("JobState") in ENDED:
            break
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} saved no checkpoint within {timeout:g} s: {slurm.job(job_id)}")


def _output(tmp_path: Path, name: str, job_id: str) -> str:
    return (tmp_path / f"{name}-{job_id}.out").read_text()


@pytest.mark.slow  # starts SLURM's daemons and three jobs of two processes
def test_scancel_term_saves_exits_75_and_the_requeued_job_resumes_to_the_same_weights(slurm, tmp_path):
    script = _script(tmp_path, "toy", STEPS)

    straight = slurm.sbatch(script)
    job = slurm.wait_ended(straight)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), _output(
        tmp_path, "toy", straight)

    stopped = slurm.sbatch(script)
    run_dir = _run_dir(tmp_path, "toy", stopped)
    _wait_for_checkpoint(slurm, stopped, run_dir)
    slurm.run("scancel", "--signal=TERM", stopped)
    job = slurm.wait_ended(stopped)
    log = _output(tmp_path, "toy", stopped)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    stop = re.search(r"stopped by SIGTERM at step (\d+); checkpoint .* \(exit status 75\)", log)
    assert stop and int(stop.group(1)) < STEPS, log
    assert f"Exited with exit code {PREEMPTED_EXIT}" in log
    assert f"resumed from {run_dir / 'checkpoints' / f'step{int(stop.group(1)):08d}'} at step {stop.group(1)}" in log, log

    a = load_file(_run_dir(tmp_path, "toy", straight) / "model" / "model.safetensors")
    b = load_file(run_dir / "model" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow  # SLURM's daemons and one job of two processes
def test_slurm_signal_usr1_before_the_time_limit_saves_and_exits_75(slurm, tmp_path):
    """``#SBATCH --signal=USR1@120``: SLURM sends SIGUSR1 once less than 120 s are left. The job is submitted with
    10 minutes, and once it trains its limit is cut to 110 s from now: the signal comes at SLURM's next check, which
    may be tens of seconds later, and what is left still holds the save and the exit on a loaded machine."""
    script = _script(tmp_path, "usr1", 100_000)
    job_id = slurm.sbatch(script, "--time=10", "--no-requeue")  # no requeue: the 75 stays the job's status
    run_dir = _run_dir(tmp_path, "usr1", job_id)
    _wait_for_checkpoint(slurm, job_id, run_dir)
    start = slurm.job(job_id)["RunTime"]  # [D-]HH:MM:SS
    elapsed = sum(int(x) * m for x, m in zip(reversed(start.split("-")[-1].split(":")), (1, 60, 3600)))
    limit = elapsed + 110
    slurm.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit // 60}:{limit % 60:02d}")
    job = slurm.wait_ended(job_id)
    log = _output(tmp_path, "usr1", job_id)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", f"{PREEMPTED_EXIT}:0"), log
    stop = re.search(r"stopped by SIGUSR1 at step (\d+)", log)
    assert stop, log
    assert read_marker(complete_checkpoints(run_dir / "checkpoints")[-1]).get("step") == int(stop.group(1))
