"""Environment report: versions, GPUs, compilers, whether DeepSpeed's ops can be built here, which of zerotrain's
DeepSpeed patches are active for the installed version; and the
just-in-time builds of those ops, announced before they start and done ahead of time by ``zerotrain doctor --build``.

DeepSpeed compiles an op (CPUAdam, FusedAdam, the shared-memory communication op, AsyncIO) the first time a
run needs it, through ``torch.utils.cpp_extension.load``, into ``<torch extensions root>/<op>/``. That takes
minutes with no output, and torch guards the folder with a ``lock`` file that an interrupted build leaves
behind, after which every later run waits on it forever. :func:`prepare_ops` runs before DeepSpeed would
build: it removes such a stale lock (or names a live one) and says in one line what is about to be built and
roughly how long it takes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from zerotrain.engines import optimizers
from zerotrain.engines.ds_private.patches import (
    PATCHES,
    installed_version,
    patches_for,
    unverified_line,
)
from zerotrain.errors import UserError
from zerotrain.runtime.launcher import sanitize_cuda_arch_list

# The ops zerotrain's strategies use: FusedAdam (GPU Adam), CPUAdam (optimizer offload),
# AsyncIO (NVMe offload), and the shared-memory collectives DeepSpeed builds for any CPU run.
OPS = {"ShareMemCommBuilder": "shared-memory communication op (CPU runs)",
       "FusedAdamBuilder": "FusedAdam (GPU optimizer)",
       "CPUAdamBuilder": "DeepSpeedCPUAdam (--strategy.offload_optimizer cpu)",
       "AsyncIOBuilder": "AsyncIO (nvme offload)"}

JIT_OPS = {
    "ShareMemCommBuilder": ("DeepSpeed's shared-memory communication op (CPU runs)", "1-5 minutes"),
    "CPUAdamBuilder": ("DeepSpeedCPUAdam (CPU optimizer offload)", "2-25 minutes"),
    "CPUAdagradBuilder": ("DeepSpeedCPUAdagrad (CPU optimizer offload of adagrad)", "2-25 minutes"),
    "FusedAdamBuilder": ("FusedAdam (the GPU optimizer)", "1-5 minutes"),
    "AsyncIOBuilder": ("AsyncIO (NVMe offload)", "1-3 minutes"),
}
"""Builder name -> (what it is, how long its first build takes). The spans are first builds on hosts from a
busy 2-core machine (the long end) to an idle many-core one; the build is one compiler process per source file."""

LOCK_GRACE_S = 120.0
"""A lock younger than this, or in a folder written to this recently, may belong to a build that has taken
the lock but not started its compiler yet (or has just finished and loads the library): it is left alone."""

log = logging.getLogger("zerotrain")


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
            "deepspeed patches": deepspeed_patches(), "NVMe offload": nvme_offload_status()}


def deepspeed_patches() -> dict[str, str]:
    """Each of zerotrain's DeepSpeed patches: active on the installed version (where its conditions hold on the
    built engine), or off and why."""

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


LIBAIO_INSTALL = ("Debian/Ubuntu: apt install libaio-dev; RHEL: yum install libaio-devel; "
                  "or conda install -c conda-forge libaio")
"""How to get libaio and its headers, which DeepSpeed's async I/O op (NVMe offload) is compiled against."""

LIBAIO_PREFIX = ("libaio under another prefix P (conda: $CONDA_PREFIX): export CPATH=P/include LIBRARY_PATH=P/lib "
                 "LD_LIBRARY_PATH=P/lib")
"""What the compiler and the loader need to find a libaio outside the system folders: the op is compiled by the
system compiler, which reads CPATH and LIBRARY_PATH, and loaded by the dynamic loader, which reads LD_LIBRARY_PATH."""


def libaio_loadable() -> bool:
    """Whether the dynamic loader finds libaio's shared library (``libaio.so.1``): the runtime half of what the
    async I/O op needs; the headers, the other half, only the op's own check sees."""
    for name in (ctypes.util.find_library("aio"), "libaio.so.1"):
        if not name:
            continue
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def nvme_offload_status() -> str:
    """``ready`` where DeepSpeed's async I/O op can be built here (its own check: it compiles and links a
    program calling libaio's ``io_submit``), else what is missing and how to install it, in one line."""
    try:
        ready = op_buildable("AsyncIOBuilder")
    except Exception as exc:  # deepspeed missing or broken: the report says so in its own section
        return f"unknown (DeepSpeed's async I/O op cannot be checked: {type(exc).__name__}: {exc})"
    if ready:
        return "ready"
    if libaio_loadable():
        return (f"needs libaio's headers (libaio.so.1 is installed, libaio.h is not found; {LIBAIO_INSTALL}; "
                f"{LIBAIO_PREFIX})")
    return f"needs libaio ({LIBAIO_INSTALL})"


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
            if not builder.is_compatible(verbose=False):
                out[what] = "NOT compatible here"
            elif _installed(builder) or is_built(extensions_root() / builder.name, builder.name):
                out[what] = "built"
            else:
                out[what] = "can be built (on first use, or now: zerotrain doctor --build)"
        except Exception as exc:
            out[what] = f"check failed: {type(exc).__name__}: {exc}"
    return out


# ---- just-in-time builds -------------------------------------------------------------------------
def extensions_root() -> Path:
    """The folder torch builds extensions under: ``$TORCH_EXTENSIONS_DIR``, else
    ``<torch.utils.cpp_extension.get_default_build_root()>/py<major><minor>_<cpu|cuXYZ|rocmXYZ>``
    (torch's own rule in ``cpp_extension.load``)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    named = os.environ.get("TORCH_EXTENSIONS_DIR")
    if named:
        return Path(named)
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accelerator}"


def check_writable_root(root: Path, what: str) -> None:
    """One line naming the folder (and TORCH_EXTENSIONS_DIR) when an op must be built under ``root`` and that
    folder cannot be made or written: torch's build would fail after its compiler started, with a traceback."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        named = f"TORCH_EXTENSIONS_DIR {root}"
    else:  # a folder under HOME's cache, named without the Python and accelerator tag torch adds
        named = f"the default TORCH_EXTENSIONS_DIR (a folder under {root.parent})"
    problem = None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = f"cannot be created ({exc.strerror or exc})"
    else:
        if not root.is_dir():
            problem = "is a file"
        elif not os.access(root, os.W_OK | os.X_OK):
            problem = "is not writable"
    if problem:
        raise UserError(f"{named} {problem}, and {what} must be built there: set TORCH_EXTENSIONS_DIR to a "
                        "writable folder")


def _builder(op: str) -> Any:
    """DeepSpeed's builder of ``op`` for this machine's accelerator; None when it has none or cannot build it."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(op)
    if builder is None or not builder.is_compatible(verbose=False):
        return None
    return builder


def _installed(builder: Any) -> bool:
    """The op was compiled when DeepSpeed was installed (``DS_BUILD_*``): nothing is built at run time."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(builder.name)) and accelerator_name == get_accelerator()._name


def is_built(build_dir: Path, name: str) -> bool:
    """A library of the extension ``name`` is in ``build_dir`` (torch names it ``<name>.so``, or ``<name>_v<N>.so``
    after the sources changed). A DeepSpeed upgrade can still make torch rebuild it."""
    return build_dir.is_dir() and any(build_dir.glob(f"{name}*.so"))


def _processes_in(folder: Path) -> list[int]:
    """Pids of this host's processes whose working directory is ``folder`` or below (ninja and the compilers run
    there during a build); [] when /proc cannot tell."""
    target = os.path.realpath(folder)
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone, or another user's
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            found.append(int(entry.name))
    return found


def clear_stale_lock(build_dir: Path, what: str, now: Optional[float] = None, say_live: bool = True) -> Optional[str]:
    """Remove ``build_dir/lock`` when no build owns it; return the line that says what was done (None: no lock, or
    a lock that may be live when ``say_live`` is false).

    torch's build lock is a bare file (it records no owner): a build holds it from before its compiler starts
    until its library is loaded, and a build that was killed leaves it, after which torch waits for it to go,
    forever. Here it is stale when no process of this host works in ``build_dir`` (ninja and the compilers do,
    for as long as the build runs) and neither the lock nor anything in the folder changed in the last
    :data:`LOCK_GRACE_S` seconds. A lock that may be live is left, and the line names it and how to remove it.
    On a folder shared between hosts (``TORCH_EXTENSIONS_DIR`` on a network disk) a build running on another
    host is seen by its files only: a compile of one file that outlasts the grace period there looks stale.
    """
    lock = build_dir / "lock"
    try:
        lock_mtime = lock.stat().st_mtime
    except FileNotFoundError:
        return None
    now = time.time() if now is None else now
    busy = _processes_in(build_dir)
    newest = max([lock_mtime] + [p.stat().st_mtime for p in build_dir.iterdir() if p.is_file()], default=lock_mtime)
    if busy or now - newest < LOCK_GRACE_S or not Path("/proc").is_dir():
        if not say_live:
            return None
        owner = f"processes {', '.join(map(str, busy[:4]))} work there" if busy else "it changed recently"
        return (f"waiting for another build of {what} to finish ({owner}): {lock} is its lock. If no build runs "
                f"(an interrupted one leaves the lock behind), stop this run and remove it: rm {lock}")
    try:
        lock.unlink()
    except FileNotFoundError:  # its build just finished
        return None
    except OSError as exc:

        raise UserError(f"{lock} is left from an interrupted build of {what} and cannot be removed "
                        f"({exc.strerror or exc}). Remove it by hand: rm {lock}") from None
    age_min = (now - newest) / 60
    return f"removed {lock}, left by an interrupted build of {what} ({age_min:.0f} min old, no build running)"


def prepare_ops(ops: Iterable[str], say: Callable[[str], None] = log.info) -> list[str]:
    """Before DeepSpeed loads ``ops`` (builder names, e.g. "CPUAdamBuilder"): clear each one's stale build lock
    and say in one line which will be compiled now and roughly for how long. Returns the ops to be built.

    Ops the accelerator has no compatible builder for, and ops compiled at install time, are skipped: DeepSpeed
    reports the former itself, the latter are never built at run time.
    """
    to_build = []
    for op in ops:
        builder = _builder(op)
        if builder is None or _installed(builder):
            continue
        what, how_long = JIT_OPS.get(op, (op, "minutes"))
        build_dir = extensions_root() / builder.name
        built = is_built(build_dir, builder.name)
        if not built:
            check_writable_root(extensions_root(), what)
        # A built op's lock that may be live is another process loading it: torch takes the same lock to check
        # that the library is current, for moments, so there is nothing to wait for or to say
        line = clear_stale_lock(build_dir, what, say_live=not built)
        if line:
            say(line)
        if not is_built(build_dir, builder.name):
            say(f"building {what} once for this machine, which may take {how_long} with no output, into {build_dir}. "
                "zerotrain doctor --build builds the ops ahead of time")
            to_build.append(op)
    return to_build


def ops_for(ds_config: dict[str, Any]) -> list[str]:
    """The ops ``deepspeed.initialize`` compiles for this DeepSpeed config: the optimizer table's host op under
    optimizer offload (CPUAdam for Adam), its GPU op otherwise (FusedAdam, unless ``torch_adam``), AsyncIO for
    NVMe offload."""
    zero = ds_config.get("zero_optimization") or {}
    devices = {str((zero.get(k) or {}).get("device", "none")).lower() for k in ("offload_optimizer", "offload_param")}
    optimizer = ds_config.get("optimizer") or {}
    row = optimizers.by_ds_type(optimizer.get("type", ""))
    ops = []
    if row is not None:
        offloaded = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower() in ("cpu", "nvme")
        if offloaded and row.offload_op:
            ops.append(row.offload_op)
        elif not offloaded and row.gpu_op and not (optimizer.get("params") or {}).get("torch_adam"):
            ops.append(row.gpu_op)
    if "nvme" in devices:
        ops.append("AsyncIOBuilder")
    return ops


def build_ops(say: Callable[[str], None] = print) -> dict[str, str]:
    """Build every op this machine can build (``zerotrain doctor --build``): op -> what happened.

    The same lines as a run's first use (:func:`prepare_ops`), then DeepSpeed's own build of each.
    """
    from deepspeed.accelerator import get_accelerator

    # On a CPU, zerotrain's Adam without offload is torch's (``torch_adam``): FusedAdam is a GPU op only.
    on_cpu = get_accelerator().device_name() == "cpu"
    ops = ["ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder"] if on_cpu else \
        ["FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder"]
    results = {}
    for op in ops:
        what = JIT_OPS[op][0]
        builder = _builder(op)
        if builder is None:
            results[what] = "not buildable here (zerotrain doctor says why)"
            continue
        prepare_ops([op], say)
        t0 = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a failed compile: the report goes on to the next op
            results[what] = f"FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        else:
            results[what] = f"ready ({time.perf_counter() - t0:.0f} s)"
        say(f"{what}: {results[what]}")
    return results
