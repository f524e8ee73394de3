"""The optimizers zerotrain trains with: one table, read by every engine, the DeepSpeed JSON and the memory model.

Each row says how the plain engine builds the optimizer (a ``torch.optim`` class), what DeepSpeed's JSON calls it
(``optimizer.type`` and its ``params``), which DeepSpeed op runs it (FusedAdam on a GPU, DeepSpeedCPUAdam under
optimizer offload), and how many state tensors of a parameter's size it keeps per trainable parameter (Adam: two
moments; SGD: a momentum buffer, or nothing without momentum). The memory model multiplies that count by the
state's bytes (:mod:`zerotrain.engines.states`).

``--optimizer.name`` also takes a class path, ``torch.optim.RMSprop`` or ``my_package.module:MyOptimizer``: the
plain engine builds it, and DeepSpeed gets it as a client optimizer (``deepspeed.initialize(optimizer=...)``).
Its constructor gets ``lr`` and, of ``betas``, ``eps``, ``weight_decay`` and ``momentum``, those it accepts. Its
state count is the class attribute ``STATES_PER_PARAMETER`` where it declares one, else measured: one step on a
small parameter, counting the state tensors of that parameter's size.

This module imports nothing from zerotrain but the errors, and torch only when it builds: the config validates
names against it, and the planner reads it on models built on the meta device.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from zerotrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from zerotrain.config import OptimizerConfig


def _adam_params(w_mode: bool) -> Callable[["OptimizerConfig", str, bool], dict[str, Any]]:
    def params(o: "OptimizerConfig", device: str, offloading: bool) -> dict[str, Any]:
        # FusedAdam is a CUDA kernel: on a CPU without offload ``torch_adam`` selects torch's Adam.
        return {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                "torch_adam": device == "cpu" and not offloading, "adam_w_mode": w_mode}
    return params


def _adam_kwargs(o: "OptimizerConfig", device: str) -> dict[str, Any]:
    return {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay,
            **({"fused": True} if device == "cuda" else {})}


@dataclass(frozen=True)
class OptimizerKind:
    """One row of the table."""

    name: str
    """What ``--optimizer.name`` says."""
    about: str
    """One line for the docs and the error that lists the choices."""
    torch_class: str
    """The ``torch.optim`` class the plain engine builds (as ``module.Class``)."""
    torch_kwargs: Callable[["OptimizerConfig", str], dict[str, Any]]
    """Its constructor's arguments, from the config and the device type ("cuda" or "cpu")."""
    ds_type: str
    """DeepSpeed JSON ``optimizer.type``."""
    ds_params: Callable[["OptimizerConfig", str, bool], dict[str, Any]]
    """DeepSpeed JSON ``optimizer.params``, from the config, the device type and whether the optimizer is offloaded."""
    states: Callable[["OptimizerConfig"], int]
    """State tensors of a parameter's size kept per trainable parameter."""
    gpu_op: Optional[str] = None
    """DeepSpeed op builder that runs it on a GPU (compiled on first use); None: a torch optimizer."""
    offload_op: Optional[str] = None
    """DeepSpeed op builder of its host optimizer under ``--strategy.offload_optimizer`` (DeepSpeedCPUAdam...);
    None: DeepSpeed steps the torch optimizer on the host's partition."""
    zero_tested: bool = True
    """Whether DeepSpeed's ZeRO stages list it as tested; others need ``zero_allow_untested_optimizer``."""


OPTIMIZERS: dict[str, OptimizerKind] = {k.name: k for k in (
    OptimizerKind("adamw", "Adam with decoupled weight decay (the default)", "torch.optim.AdamW", _adam_kwargs,
                  "AdamW", _adam_params(True), lambda o: 2, gpu_op="FusedAdamBuilder", offload_op="CPUAdamBuilder"),
    OptimizerKind("adam", "Adam with L2 weight decay", "torch.optim.Adam", _adam_kwargs,
                  "Adam", _adam_params(False), lambda o: 2, gpu_op="FusedAdamBuilder", offload_op="CPUAdamBuilder"),
    OptimizerKind("sgd", "SGD, with --optimizer.momentum (0: no state at all)", "torch.optim.SGD",
                  lambda o, device: {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay},
                  "SGD", lambda o, device, offloading: {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay},
                  lambda o: 1 if o.momentum else 0, zero_tested=False),
    OptimizerKind("adagrad", "Adagrad (one accumulator a parameter)", "torch.optim.Adagrad",
                  lambda o, device: {"lr": o.lr, "eps": o.eps, "weight_decay": o.weight_decay},
                  "Adagrad", lambda o, device, offloading: {"lr": o.lr, "eps": o.eps, "weight_decay": o.weight_decay},
                  lambda o: 1, offload_op="CPUAdagradBuilder"),
)}


def is_class_path(name: str) -> bool:
    """``torch.optim.SGD`` or ``my_package.module:MyOptimizer`` rather than a table name."""
    return ":" in name or "." in name


def choices() -> str:
    return ", ".join(OPTIMIZERS) + " or a class path (torch.optim.RMSprop, my_package.module:MyOptimizer)"


def kind(name: str) -> Optional[OptimizerKind]:
    """The table row of ``name``; None for a class path. Raises ConfigError naming the flag for anything else."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    if is_class_path(name):
        return None
    raise ConfigError("--optimizer.name", f"= {name!r} is not an optimizer: choose {choices()}")


def resolve_class(path: str) -> type:
    """The optimizer class a path names; one line naming ``--optimizer.name`` when it cannot be imported."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError("--optimizer.name", f"= {path!r} cannot be imported ({exc}): give module.Class or "
                          f"module:Class of a torch.optim.Optimizer, or one of {', '.join(OPTIMIZERS)}") from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("--optimizer.name", f"= {path!r} is not a torch.optim.Optimizer subclass: name one, or "
                          f"one of {', '.join(OPTIMIZERS)}")
    return cls


def _class_kwargs(cls: type, o: "OptimizerConfig") -> dict[str, Any]:
    """``lr`` and those of the config's other fields the constructor takes by name."""
    accepted = inspect.signature(cls.__init__).parameters
    offered = {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay, "momentum": o.momentum}
    return {k: v for k, v in offered.items() if k == "lr" or k in accepted}


def build(params: list["torch.nn.Parameter"], o: "OptimizerConfig", device: str) -> "torch.optim.Optimizer":
    """The torch optimizer ``o`` names over ``params``: the plain engine's, and DeepSpeed's client optimizer for a
    class path."""
    row = kind(o.name)
    if row is None:
        cls = resolve_class(o.name)
        return cls(params, **_class_kwargs(cls, o))
    module, _, attr = row.torch_class.rpartition(".")
    return getattr(importlib.import_module(module), attr)(params, **row.torch_kwargs(o, device))


def ds_block(o: "OptimizerConfig", device: str, offloading: bool) -> Optional[dict[str, Any]]:
    """DeepSpeed JSON's ``optimizer`` block for ``o``; None for a class path (a client optimizer instead)."""
    row = kind(o.name)
    if row is None:
        return None
    return {"type": row.ds_type, "params": row.ds_params(o, device, offloading)}


def by_ds_type(ds_type: str) -> Optional[OptimizerKind]:
    """The row whose DeepSpeed ``optimizer.type`` is ``ds_type`` (any case); None for one not in the table."""
    return next((row for row in OPTIMIZERS.values() if row.ds_type.lower() == str(ds_type).lower()), None)


PROBE_ELEMENTS = 64
"""Elements of the parameter a class path's optimizer takes one step on to count its states."""


def state_count(o: "OptimizerConfig") -> int:
    """State tensors of a parameter's size that the optimizer ``o`` names keeps per trainable parameter."""
    row = kind(o.name)
    if row is not None:
        return row.states(o)
    cls = resolve_class(o.name)
    declared = getattr(cls, "STATES_PER_PARAMETER", None)
    if isinstance(declared, int):
        return declared
    return measure_states(cls, o)


def measure_states(cls: type, o: "OptimizerConfig") -> int:
    """One step of ``cls`` on a small fp32 parameter: its state tensors of that parameter's size."""
    import torch

    weight = torch.nn.Parameter(torch.zeros(PROBE_ELEMENTS))
    weight.grad = torch.full_like(weight, 1e-3)
    opt = cls([weight], **_class_kwargs(cls, o))
    opt.step()
    return sum(1 for v in opt.state[weight].values() if torch.is_tensor(v) and v.numel() == PROBE_ELEMENTS)

