"""Environment report: versions, GPUs, compilers, whether DeepSpeed's ops can be built here, and which of zerotrain's
DeepSpeed patches are active for the installed version."""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
from typing import Any

from zerotrain.runtime.launcher import sanitize_cuda_arch_list

# The ops zerotrain's strategies use: FusedAdam (GPU Adam), CPUAdam (optimizer offload),
# AsyncIO (NVMe offload).
OPS = {"FusedAdamBuilder": "FusedAdam (GPU optimizer)",
       "CPUAdamBuilder": "DeepSpeedCPUAdam (--strategy.offload_optimizer cpu)",
       "AsyncIOBuilder": "AsyncIO (nvme offload)"}


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def _tool(cmd: list[str]) -> str:
    if not shutil.which(cmd[0]):
        return "not found"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    lines = [l for l in (out.stdout or out.stderr).splitlines() if l.strip()]
    return lines[-1].strip() if cmd[0] == "nvcc" and lines else (lines[0].strip() if lines else "?")


def report() -> dict[str, Any]:
    old_arch = sanitize_cuda_arch_list()
    import torch

    versions = {p: _version(p) for p in ("zerotrain", "torch", "deepspeed", "transformers", "datasets",
                                         "tokenizers", "peft", "safetensors", "jsonargparse")}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
    cuda = {
        "torch CUDA": torch.version.cuda or "none (CPU build)",
        "bf16 supported": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "(unset)")
        + (f"  (was {old_arch!r}; zerotrain rewrites it so DeepSpeed's op builder can parse it)" if old_arch else ""),
        "distributed backends": ", ".join(b for b, ok in (("nccl", torch.distributed.is_nccl_available()),
                                                         ("gloo", torch.distributed.is_gloo_available()),
                                                         ("mpi", torch.distributed.is_mpi_available())) if ok),
    }
    compilers = {"gcc": _tool(["gcc", "--version"]), "nvcc": _tool(["nvcc", "--version"]),
                 "ninja": _tool(["ninja", "--version"])}
    return {"versions": versions, "gpus": gpus, "cuda": cuda, "compilers": compilers, "deepspeed ops": _ops(),
            "deepspeed patches": deepspeed_patches()}


def deepspeed_patches() -> dict[str, str]:
    """Each of zerotrain's DeepSpeed patches: active on the installed version (where its conditions hold on the
    built engine), or off and why."""
    from zerotrain.engines.ds_private.patches import PATCHES, installed_version, patches_for, unverified_line

    version = installed_version()
    active = {p.name for p in patches_for(version)}
    out = {p.name: (f"active on DeepSpeed {version} where it applies: {p.what}" if p.name in active
                    else f"off: verified on DeepSpeed {', '.join(p.verified_versions)} only") for p in PATCHES}
    line = unverified_line(version)
    if line is not None:
        out["note"] = line
    return out


def op_buildable(op: str) -> bool:
    """Whether DeepSpeed's ``op`` builder (e.g. "AsyncIOBuilder") can build it here, by its own check."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(op)
    return builder is not None and bool(builder.is_compatible(verbose=False))


def _ops() -> dict[str, str]:
    try:
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # deepspeed missing or broken
        return {"deepspeed": f"cannot import: {exc}"}
    acc = get_accelerator()
    out = {"accelerator": acc.device_name()}
    for op, what in OPS.items():
        try:
            builder = acc.create_op_builder(op)
            if builder is None:
                out[what] = "no builder for this accelerator"
                continue
            ok = builder.is_compatible(verbose=False)
            out[what] = "can be built (JIT on first use)" if ok else "NOT compatible here"
        except Exception as exc:
            out[what] = f"check failed: {type(exc).__name__}: {exc}"
    return out
