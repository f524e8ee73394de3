"""Job templates for a ``zerotrain fit`` command: an sbatch script, a Kubeflow ``PyTorchJob``, a SkyPilot task.

Each template runs the command as the scheduler expects and wires what a cluster needs to survive a
pre-emption without a person:

* the run folder on storage every node sees (``--trainer.output_dir``), under a run name that stays the same
  when the scheduler restarts the job (SLURM keeps the job id across a requeue; Kubernetes and SkyPilot keep
  the job name), with ``--checkpoint.resume auto``: a restarted job continues from the newest complete
  checkpoint, a new one starts fresh;
* the stop signal: SLURM's ``--signal=USR1@N`` (SIGUSR1 N seconds before the time limit) and Kubernetes'
  ``terminationGracePeriodSeconds`` (SIGTERM, then SIGKILL that long after) give the run time to save
  (:mod:`zerotrain.runtime.preemption`);
* the requeue status :data:`~zerotrain.runtime.preemption.PREEMPTED_EXIT`: the sbatch script requeues the job
  on it (``--requeue``, ``scontrol requeue``), the PyTorchJob restarts its pods on failure, SkyPilot restarts a
  managed job on an error (``job_recovery.max_restarts_on_errors``) and after a spot pre-emption.

The processes: under SLURM one task per process (``srun`` gives each its rank; zerotrain maps SLURM's
variables onto torchrun's); under Kubernetes and SkyPilot one zerotrain launcher per node
(``--launch.nnodes/node_rank/rdzv_endpoint`` from the variables they set). Not ``torchrun``: it ends with status
1 whatever its workers' status, and the requeue status would be lost.

The topology comes from the fit command itself (its ``--launch.nnodes``, ``--launch.nproc_per_node``,
``--trainer.device``, parsed with its ``--config``); the flags the template sets are taken out of the command
so that each appears once.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

import yaml

from zerotrain.config.flags import parse_config
from zerotrain.errors import ConfigError, UserError
from zerotrain.runtime.preemption import PREEMPTED_EXIT

KINDS = ("slurm", "kubernetes", "skypilot")

SET_BY_TEMPLATE = ("--trainer.output_dir", "--trainer.run_name", "--checkpoint.resume", "--launch.nnodes",
                   "--launch.node_rank", "--launch.rdzv_endpoint", "--launch.nproc_per_node")
"""Flags of the fit command each template sets itself (from the scheduler's variables); taken out of it."""

RDZV_PORT = 29500


@dataclasses.dataclass
class JobSpec:
    """What a template needs: the zerotrain arguments (``fit RECIPE ...``, without :data:`SET_BY_TEMPLATE`), the
    topology, where runs live, and how long a stop signal leaves to save."""

    args: list[str]
    nnodes: int = 1
    nproc_per_node: int = 1
    gpus: bool = True
    """Whether each process has a GPU (False for ``--trainer.device cpu``): the templates request nodes' GPUs."""
    shared_dir: str = "/shared/zerotrain-runs"
    """The folder of runs, on storage every node mounts at this path."""
    run_name: str | None = None
    """A fixed run name (the fit command's); None: the scheduler's job id or name, stable across restarts."""
    job_name: str = "zerotrain"
    grace_s: int = 120
    """Seconds between the stop signal and the kill: time to save a checkpoint."""
    exe: str = "zerotrain"
    """The command that runs zerotrain on the nodes (e.g. ``/opt/venv/bin/python -m zerotrain``)."""
    every_steps: int = 0
    """The fit command's ``--checkpoint.every_steps``: 0 means a node lost without a signal resumes from the start."""
    image: str = "REGISTRY/IMAGE:TAG"
    """Kubernetes: the container image with zerotrain installed."""
    claim: str = "zerotrain-runs"
    """Kubernetes: the PersistentVolumeClaim (ReadWriteMany) mounted at :attr:`shared_dir`."""
    bucket: str = "s3://BUCKET/zerotrain-runs"
    """SkyPilot: the bucket mounted at :attr:`shared_dir`."""
    accelerator: str = "H100"
    """SkyPilot: the GPU type."""


def job_spec(argv: list[str], **settings) -> JobSpec:
    """The :class:`JobSpec` of ``zerotrain ARGV`` (``fit RECIPE [flags]``), its config parsed as ``fit`` would."""
    if len(argv) < 2 or argv[0] != "fit" or argv[1].startswith("-"):
        raise UserError("give the command to run after --, e.g. `zerotrain launch --emit slurm -- "
                        "fit mlm --config my.yaml`")
    cfg = parse_config(argv[1], argv[2:]).validate()
    if cfg.launch.max_restarts:
        raise ConfigError("--launch.max_restarts", "restarts the workers of zerotrain's own launcher; in a job file "
                          "the scheduler restarts or requeues the job (the template wires it): leave it out")
    spec = JobSpec(args=without_flags(argv, SET_BY_TEMPLATE), nnodes=cfg.launch.nnodes,
                   nproc_per_node=cfg.launch.nproc_per_node, gpus=cfg.trainer.device != "cpu",
                   run_name=cfg.trainer.run_name, every_steps=cfg.checkpoint.every_steps)
    if cfg.trainer.output_dir != type(cfg.trainer)().output_dir:
        spec.shared_dir = cfg.trainer.output_dir
    for key, value in settings.items():
        if value is not None:
            setattr(spec, key, value)
    check_spec(spec)
    return spec


JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A job name every scheduler takes and that is a run name as it is (Kubernetes' DNS label: lowercase letters,
digits and ``-``, at most 63 characters); written into the job file unquoted and into the run's name."""


def check_spec(spec: JobSpec) -> None:
    """Refuse, in one line naming the flag, what would make a broken or different job file: a control character
    in any value (a newline in a comment or an ``#SBATCH`` line would start a shell line of its own), a job name
    the scheduler refuses on the cluster, long after the file was written."""
    values = [("--job_name", spec.job_name), ("--shared_dir", spec.shared_dir), ("--exe", spec.exe),
              ("--image", spec.image), ("--claim", spec.claim), ("--bucket", spec.bucket),
              ("--accelerator", spec.accelerator)]
    values += [("the command after --", arg) for arg in spec.args]
    for flag, value in values:
        bad = next((ch for ch in value if ord(ch) < 32 or ord(ch) == 127), None)
        if bad is not None:
            raise ConfigError(flag, f"{value!r} holds the control character {bad!r}, which would break the job file: "
                                    "leave it out")
    if not JOB_NAME.fullmatch(spec.job_name):
        raise ConfigError("--job_name", f"{spec.job_name!r} is no name every scheduler takes: pass lowercase letters, "
                                        "digits and '-' (at most 63, starting and ending with a letter or digit), "
                                        "such as my-run-1")


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag VALUE`` and ``--flag=VALUE``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif arg.partition("=")[0] not in flags:
            out.append(arg)
    return out


def emit(kind: str, spec: JobSpec) -> str:
    """The template ``kind`` (one of :data:`KINDS`) for ``spec``, as the text of its file."""
    if kind == "slurm":
        return slurm_script(spec)
    body = pytorch_job(spec) if kind == "kubernetes" else skypilot_task(spec)
    return _header(spec, "#") + yaml.dump(body, Dumper=_Dumper, sort_keys=False, width=120)


class _Dumper(yaml.SafeDumper):
    """YAML for a person to edit: shell scripts as literal blocks, each part written out (no ``&id`` aliases)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _str)


def _command(spec: JobSpec, *extra: str) -> str:
    """The shell line that runs zerotrain: the fit command, then the flags the template sets (``extra``, already
    shell words: they may hold variables)."""
    return " ".join([spec.exe, *(shlex.quote(a) for a in spec.args), *extra])


def _header(spec: JobSpec, comment: str) -> str:
    lines = [f"zerotrain {shlex.join(spec.args)}",
             f"{spec.nnodes} node(s) x {spec.nproc_per_node} process(es); runs in {spec.shared_dir} (shared storage)",
             (f"A stop signal saves a checkpoint and exits with {PREEMPTED_EXIT}; the restarted job resumes it "
              "(--checkpoint.resume auto).")]
    if spec.every_steps == 0:
        lines.append("A node lost without a signal resumes from the last save: set --checkpoint.every_steps N.")
    return "".join(f"{comment} {line}\n" for line in lines)


def _run_flags(run_name: str) -> list[str]:
    """``run_name``: one shell word already (the scheduler's variables in double quotes, or a quoted name)."""
    return ["--trainer.output_dir", '"$RUN_ROOT"', "--trainer.run_name", run_name, "--checkpoint.resume", "auto"]


# --- SLURM ----------------------------------------------------------------------------------------------------

def slurm_script(spec: JobSpec) -> str:
    """An sbatch script: one task per process, ``--signal=USR1@grace``, ``--requeue``, and a requeue on status 75.

    The run name is ``JOBNAME-JOBID`` unless the command names one: a requeued job keeps its id, so it finds its
    checkpoints. Output of every attempt goes to one file (``--open-mode=append``). ``--kill-on-bad-exit=0``:
    ranks finish their pre-emption save at slightly different times, and the first to exit must not get the others
    killed before they exit 75 too (a rank that fails for real ends the others after ``--launch.timeout_minutes``).
    """
    directives = [f"--job-name={spec.job_name}", f"--nodes={spec.nnodes}", f"--ntasks-per-node={spec.nproc_per_node}"]
    if spec.gpus:
        directives.append(f"--gpus-per-node={spec.nproc_per_node}")
    directives += [f"--signal=USR1@{spec.grace_s}", "--requeue", "--open-mode=append", "--output=%x-%j.out"]
    run_name = shlex.quote(spec.run_name) if spec.run_name else '"${SLURM_JOB_NAME}-${SLURM_JOB_ID}"'
    rdzv = ["--launch.rdzv_endpoint", '"$HEAD:$PORT"']
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), _header(spec, "#").rstrip("\n"), "",
             f"RUN_ROOT={shlex.quote(spec.shared_dir)}",
             "# The first node hosts the rendezvous; a port of this job's own (jobs may share a node).",
             'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             "PORT=$((20000 + SLURM_JOB_ID % 20000))",
             f"srun --kill-on-bad-exit=0 {_command(spec, *_run_flags(run_name), *rdzv)}",
             "status=$?",
             f"if [ \"$status\" -eq {PREEMPTED_EXIT} ]; then",
             "  # Saved on a stop signal: back to the queue; the requeued job (same id) resumes the run.",
             '  scontrol requeue "$SLURM_JOB_ID"',
             "fi",
             'exit "$status"', ""]
    return "\n".join(lines)


# --- Kubernetes (Kubeflow training operator) ---------------------------------------------------------------------

def _node_command(spec: JobSpec, rank: str, master: str) -> str:
    flags = _run_flags(shlex.quote(spec.run_name or spec.job_name))
    flags += ["--launch.nproc_per_node", str(spec.nproc_per_node)]
    if spec.nnodes > 1:
        flags += ["--launch.nnodes", str(spec.nnodes), "--launch.node_rank", f'"{rank}"', "--launch.rdzv_endpoint",
                  f'"{master}"']
    return _command(spec, *flags)


def pytorch_job(spec: JobSpec) -> dict:
    """A Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``): one pod per node, each running zerotrain's launcher.

    The operator sets ``RANK`` to the pod's index and ``MASTER_ADDR``/``MASTER_PORT`` to the master pod; RANK and
    WORLD_SIZE are taken out of the launcher's environment (they would make it a worker of a job of pods, not the
    launcher of this pod's processes) after they gave the node rank. ``restartPolicy: OnFailure`` restarts a pod
    that exits non-zero (75 after a pre-emption save), ``runPolicy.backoffLimit`` bounds the restarts;
    the operator's ``ExitCode`` policy would not do: it treats 1-127 as permanent.
    """
    script = (f"RUN_ROOT={shlex.quote(spec.shared_dir)}\n"
              f"exec env -u RANK -u WORLD_SIZE -u LOCAL_RANK {_node_command(spec, '$RANK', '$MASTER_ADDR:$MASTER_PORT')}\n")
    container: dict = {"name": "pytorch", "image": spec.image, "command": ["/bin/sh", "-c", script],
                       "volumeMounts": [{"name": "runs", "mountPath": spec.shared_dir},
                                        {"name": "dshm", "mountPath": "/dev/shm"}]}
    if spec.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.nproc_per_node}}
    pod = {"spec": {"terminationGracePeriodSeconds": spec.grace_s, "containers": [container],
                    "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": spec.claim}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if spec.nnodes > 1:
        replicas["Worker"] = {"replicas": spec.nnodes - 1, "restartPolicy": "OnFailure", "template": pod}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": spec.job_name},
            "spec": {"runPolicy": {"backoffLimit": 10, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": replicas}}


# --- SkyPilot -----------------------------------------------------------------------------------------------------

def skypilot_task(spec: JobSpec) -> dict:
    """A SkyPilot task (``sky jobs launch``): ``num_nodes`` nodes, the bucket mounted at the run folder, and
    ``job_recovery`` restarting the job after a spot pre-emption and, up to 3 times, after a non-zero exit
    (75 after a save on SIGTERM). The node rank, node list and GPU count come from SkyPilot's variables."""
    resources: dict = {"job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": 3}}
    if spec.gpus:
        resources["accelerators"] = f"{spec.accelerator}:{spec.nproc_per_node}"
    head = 'HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)\n' if spec.nnodes > 1 else ""
    run = (f"RUN_ROOT={shlex.quote(spec.shared_dir)}\n{head}"
           f"{_node_command(spec, '$SKYPILOT_NODE_RANK', f'$HEAD:{RDZV_PORT}')}\n")
    return {"name": spec.job_name, "num_nodes": spec.nnodes, "resources": resources,
            "file_mounts": {spec.shared_dir: {"source": spec.bucket, "mode": "MOUNT_CACHED"}},
            "run": run}
