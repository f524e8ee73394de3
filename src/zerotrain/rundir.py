"""The experiment directory: everything needed to see what ran and to run it again.

``<recipe>.<YYYY>.<MM>.<DD>.<HH>.<MM>.<SS>.<id>/`` holds ``hparams.json`` (the resolved config),
``ds_config.json`` (what DeepSpeed got), ``githash.log`` and ``gitdiff.log`` (the code),
``env.json`` (versions, hardware, the command line), ``metrics.jsonl``, ``tb_dir/`` and
``checkpoints/``. The layout follows DeepSpeedExamples' HelloDeepSpeed.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from zerotrain.errors import UserError


def new_run_name(recipe: str) -> str:
    now = _dt.datetime.now()
    return f"{recipe}.{now:%Y.%m.%d.%H.%M.%S}.{secrets.token_hex(3)}"


def check_writable(output_dir: str) -> Path:
    """Fail early, before minutes of data loading, if runs cannot be written under ``output_dir``."""
    root = Path(output_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".zerotrain-write-test-"):
            pass
    except OSError as exc:
        raise UserError(
            f"--trainer.output_dir: cannot write to {root} ({exc.strerror or exc}). "
            "Pass a folder you can write to, e.g. --trainer.output_dir ./runs"
        ) from None
    return root


def create(output_dir: str, name: str) -> Path:
    run = check_writable(output_dir) / name
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def _git(args: list[str], cwd: Path) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def write_code_state(run: Path) -> None:
    """githash.log and gitdiff.log of the working tree the command ran from (empty outside git)."""
    cwd = Path.cwd()
    (run / "githash.log").write_text(_git(["rev-parse", "HEAD"], cwd) or "not a git checkout\n")
    (run / "gitdiff.log").write_text(_git(["diff", "HEAD"], cwd))


def _program() -> str:
    """How the command was started: ``zerotrain``, or ``python -m zerotrain`` (also torchrun's workers)."""
    name = Path(sys.argv[0]).name
    return "python -m zerotrain" if name == "__main__.py" else name


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("zerotrain", "torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "command": " ".join([_program(), *sys.argv[1:]]),
        "cwd": str(Path.cwd()),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "versions": versions,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "cpu_count": os.cpu_count(),
        "launcher_env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                    "MASTER_PORT", "SLURM_JOB_ID", "SLURM_NNODES")
                         if k in os.environ},
    }
