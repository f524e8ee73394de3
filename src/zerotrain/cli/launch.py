"""``zerotrain launch --emit slurm|kubernetes|skypilot [--out FILE] [options] -- fit RECIPE [flags]``.

Writes a job for a cluster scheduler that runs the fit command after --: an sbatch script, a Kubeflow
PyTorchJob or a SkyPilot task. Each keeps its runs on shared storage, gives the run time to save on the
scheduler's stop signal, and restarts a job that exits with 75 (saved, pre-empted); the restarted job resumes
from the newest complete checkpoint. Nodes and processes per node come from the command's --launch.nnodes and
--launch.nproc_per_node (no GPUs with --trainer.device cpu). Edit what the template marks for your cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zerotrain.data.io import atomic_write_text
from zerotrain.errors import UserError
from zerotrain.runtime.templates import KINDS, JobSpec, emit, job_spec


def run(argv: list[str]) -> int:
    ours, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    defaults = JobSpec(args=[])
    parser = argparse.ArgumentParser(prog="zerotrain launch", description=__doc__.split("\n\n")[1],
                                     allow_abbrev=False,
                                     usage="zerotrain launch --emit {slurm,kubernetes,skypilot} [options] -- fit RECIPE ...")
    parser.add_argument("--emit", required=True, choices=KINDS, help="which scheduler's job to write")
    parser.add_argument("--out", type=Path, default=None, help="write the job to this file (default: stdout)")
    parser.add_argument("--shared_dir", default=None,
                        help=f"folder of runs on storage every node mounts (default: the command's --trainer.output_dir "
                             f"if given, else {defaults.shared_dir})")
    parser.add_argument("--job_name", default=defaults.job_name, help="the job's name (and the run's, off SLURM)")
    parser.add_argument("--grace_s", type=int, default=defaults.grace_s,
                        help="seconds from the stop signal to the kill, for the checkpoint (SLURM --signal=USR1@N, "
                             "Kubernetes terminationGracePeriodSeconds)")
    parser.add_argument("--exe", default=defaults.exe,
                        help="command that runs zerotrain on the nodes (e.g. '/opt/venv/bin/python -m zerotrain'), "
                             "written as a shell command: quote a path with spaces in it")
    parser.add_argument("--image", default=defaults.image, help="Kubernetes: container image with zerotrain")
    parser.add_argument("--claim", default=defaults.claim,
                        help="Kubernetes: PersistentVolumeClaim (ReadWriteMany) mounted at the shared folder")
    parser.add_argument("--bucket", default=defaults.bucket, help="SkyPilot: bucket mounted at the shared folder")
    parser.add_argument("--accelerator", default=defaults.accelerator, help="SkyPilot: GPU type")
    args = parser.parse_args(ours)
    if args.grace_s < 1:
        raise UserError(f"--grace_s must be >= 1 second, got {args.grace_s}")
    spec = job_spec(command, shared_dir=args.shared_dir, job_name=args.job_name, grace_s=args.grace_s,
                    exe=args.exe, image=args.image, claim=args.claim, bucket=args.bucket,
                    accelerator=args.accelerator)
    text = emit(args.emit, spec)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        atomic_write_text(args.out, text)
    except OSError as exc:  # a folder on the way that is a file, no permission, a full disk
        blocking = next((p for p in args.out.parents if p.exists()), None)
        why = (f"{blocking} is a file" if blocking is not None and not blocking.is_dir()
               else f"{args.out} is a folder" if args.out.is_dir() else exc.strerror or type(exc).__name__)
        raise UserError(f"--out: cannot write {args.out} ({why}): pass a file in a folder you can write") from None
    if args.emit == "slurm":
        args.out.chmod(0o755)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
