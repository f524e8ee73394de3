"""The DeepSpeed JSON, built from the typed config by one pure function.

Two ways in, one way out:

* :func:`build_ds_config` turns a :class:`~zerotrain.config.RunConfig` into DeepSpeed's JSON.
* A user's own JSON/HJSON file (``--strategy.deepspeed_config``) is read by :func:`load_user_config`;
  its ``"auto"`` values (Hugging Face style) are filled by :func:`resolve_auto` from the generated
  config, and its explicit values win.

Either result goes through :func:`validate_ds_config` (batch-size rule, fp16 with bf16, parameter
offload below stage 3), and the run directory gets the resolved JSON. Keys are DeepSpeed's own, so
what zerotrain writes can be read next to the DeepSpeed documentation.

:func:`portable_ds_config` gives the same configuration as a file for the Hugging Face Trainer or Lightning
(with :func:`hf_training_arguments` / :func:`lightning_trainer_arguments`, the arguments that must match it).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

from zerotrain.config import RunConfig
from zerotrain.engines import optimizers
from zerotrain.engines.ds_private.config import (
    block_type_error,
    builtin_optimizer_names,
    builtin_scheduler_names,
    zero_default,
    zero_optimization_keys,
)
from zerotrain.errors import ConfigError, UserError
from zerotrain.runtime.doctor import nvme_offload_status

ResolvedPrecision = Literal["fp32", "fp16", "bf16"]

# DeepSpeed prints its own throughput line every `steps_per_print` steps; zerotrain measures instead.
_QUIET_STEPS = 2**31 - 1


def resolve_precision(requested: str, device: str, bf16_supported: bool) -> ResolvedPrecision:
    """``auto`` is bf16 on a GPU that supports it, else fp16 on GPU, else fp32 (CPU)."""
    if requested != "auto":
        if requested == "bf16" and device == "cuda" and not bf16_supported:
            raise ConfigError("--precision.dtype", "bf16 is not supported by this GPU; use fp16 or fp32")
        if requested == "fp16" and device == "cpu":
            raise ConfigError("--precision.dtype", "fp16 needs a GPU; on CPU use fp32 or bf16")
        return requested  # type: ignore[return-value]
    if device == "cuda":
        return "bf16" if bf16_supported else "fp16"
    return "fp32"


def _offload_block(kind: str, nvme_path: str | None, pin_memory: bool) -> dict[str, Any]:
    if kind == "cpu":
        return {"device": "cpu", "pin_memory": pin_memory}
    return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin_memory}


def nvme_run_folder(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The folder a run's NVMe offload swaps into: ``--strategy.nvme_path``/``<run name>-<hash of the run folder>``,
    None where nothing goes to NVMe or a user's DeepSpeed file names the path.

    DeepSpeed swaps into fixed names under the path it is given (and empties its weights' folder when it starts),
    so two runs given the same disk would overwrite each other's states; one folder per run folder keeps them
    apart, and the same run (a resume) finds its own. The run removes it when it ends: the checkpoints hold copies
    of what a resume needs, and a 7B model's swap files are over 100 GB."""
    s = cfg.strategy
    if s.deepspeed_config or not s.nvme_path or "nvme" not in (s.offload_optimizer, s.offload_param):
        return None
    where = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return Path(s.nvme_path).expanduser() / f"{run_dir.name}-{where}"


PARAM_SWAP_BUFFER_SIZE = 100_000_000
"""DeepSpeed 0.19's default ``offload_param.buffer_size``: the elements of each pinned buffer NVMe-offloaded
weights pass through."""


def weights_on_nvme(cfg: RunConfig) -> bool:
    """Whether the run swaps its weights to NVMe: ``--strategy.offload_param nvme``, or a user's DeepSpeed file's
    ``zero_optimization.offload_param.device``."""
    if not cfg.strategy.deepspeed_config:
        return cfg.strategy.offload_param == "nvme"
    zero = load_user_config(cfg.strategy.deepspeed_config).get("zero_optimization")
    return isinstance(zero, dict) and _offload_device(zero.get("offload_param")) == "nvme"


def _size_param_swap_buffers(ds: dict[str, Any], largest: int | None, world_size: int, path: str | None) -> None:
    """Make each buffer NVMe-offloaded weights pass through hold a rank's share of the largest parameter
    (``largest`` elements over ``world_size`` ranks).

    DeepSpeed swaps each rank's partition of a parameter through one buffer and stops at the model's build where
    one is larger: a Llama 7B's 32,000 x 4,096 embedding is 131M elements on one GPU, over its default of 100M. A
    size a user's file sets is kept where it is large enough, refused in one line where it is not."""
    block = (ds.get("zero_optimization") or {}).get("offload_param")
    if not largest or not isinstance(block, dict) or block.get("device") != "nvme":
        return
    share = math.ceil(largest / world_size)  # DeepSpeed pads a parameter to a multiple of the ranks
    size = block.get("buffer_size")
    if size is None or not path:
        block["buffer_size"] = max(int(size or PARAM_SWAP_BUFFER_SIZE), share)
    elif int(float(size)) < share:
        raise ConfigError(f"--strategy.deepspeed_config {path}", f"zero_optimization.offload_param.buffer_size "
                          f"is {size}, under a rank's share of the model's largest parameter ({share:,} elements), "
                          f"which DeepSpeed swaps through one buffer: set it to {share} or more, or remove it")


def _no_reuse_of_nvme_weights(ds: dict[str, Any], users_zero: dict[str, Any] | None) -> None:
    """Under NVMe-offloaded weights, ``stage3_max_reuse_distance`` 0 where zerotrain writes the config, and where a
    user's file (``users_zero``: its ``zero_optimization`` block, before "auto" was resolved) leaves it unset or "auto".

    From the second step on, DeepSpeed keeps a weight it will use again within that many elements (default 1e9)
    gathered, in its swap buffer: with activation checkpointing a 1.07B Llama held five such weights, every buffer
    it had, and its second step stopped at "Not enough buffers 0 for swapping 1". At 0 no weight is kept by
    distance: each is read from the disk again where it is used again (2 bytes a parameter, beside the 32 that the
    fp32 master weights, gradients and moments move each step, read and written). A value a user's file sets is
    kept."""
    zero = ds.get("zero_optimization") or {}
    block = zero.get("offload_param")
    if not isinstance(block, dict) or block.get("device") != "nvme":
        return
    keys = ("stage3_max_reuse_distance", "max_reuse_distance")
    if users_zero is not None and any(users_zero.get(k, "auto") != "auto" for k in keys):
        return
    for key in keys:
        zero.pop(key, None)
    zero["stage3_max_reuse_distance"] = 0


GPU_SHARE_SUB_GROUP = 100_000_000
"""``sub_group_size`` of a generated config that keeps part of the optimizer on the GPU
(``--strategy.offload_optimizer_ratio`` below 1)."""


def build_ds_config(cfg: RunConfig, world_size: int, device: str, precision: ResolvedPrecision) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg`` on ``world_size`` data-parallel ranks of ``device`` (cuda/cpu).

    Pure: reads nothing but its arguments (and the optimizer table, :mod:`zerotrain.engines.optimizers`).
    The optimizer block is the table's (Adam: DeepSpeed's FusedAdam on GPU, DeepSpeedCPUAdam under
    optimizer offload, torch's Adam on CPU); a class path has none, as the engine hands DeepSpeed the
    optimizer it built.
    """
    s, opt = cfg.strategy, cfg.optimizer
    micro = cfg.trainer.micro_batch_size
    gas = s.gradient_accumulation_steps
    offloading = s.offload_optimizer != "none"
    ds: dict[str, Any] = {
        "train_batch_size": micro * gas * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": s.gradient_clipping,
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": precision == "bf16"},
    }
    block = optimizers.ds_block(opt, device, offloading)
    if block is not None:
        ds["optimizer"] = block
    if not (block is not None and optimizers.OPTIMIZERS[opt.name].zero_tested):
        # DeepSpeed's ZeRO stages step any torch optimizer's partition, but refuse one off their tested list
        # without this key (stage 0 ignores it; written at every stage, so a user's file whose stage differs
        # gets it too)
        ds["zero_allow_untested_optimizer"] = True
    if block is None:
        # The client optimizer steps the offloaded partition on the host, as the table's torch optimizers do
        ds["zero_force_ds_cpu_optimizer"] = False
    if cfg.precision.master_weights == "bf16":
        if precision != "bf16":  # --precision.dtype auto, resolved on this device
            raise ConfigError("--precision.master_weights bf16", f"needs bf16 training, and --precision.dtype "
                              f"{cfg.precision.dtype} is {precision} on {device}: pass --precision.dtype bf16")
        ds["bf16"]["bf16_master_weights_and_grads"] = True
        ds["bf16"]["bf16_optimizer_states"] = cfg.precision.optimizer_states == "bf16"
    if precision == "fp16":
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": cfg.precision.initial_scale_power,
            "loss_scale_window": cfg.precision.loss_scale_window,
            "hysteresis": cfg.precision.hysteresis,
            "min_loss_scale": cfg.precision.min_loss_scale,
        }
    zero: dict[str, Any] = {
        "stage": s.zero_stage,
        "overlap_comm": s.overlap_comm,
        "contiguous_gradients": s.contiguous_gradients,
        "reduce_bucket_size": s.reduce_bucket_size,
    }
    if s.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = s.allgather_bucket_size
    pin = device == "cuda" if s.offload_pin_memory is None else s.offload_pin_memory
    if offloading:
        zero["offload_optimizer"] = _offload_block(s.offload_optimizer, s.nvme_path, pin)
        if s.offload_optimizer_ratio < 1.0:
            # DeepSpeed places whole sub-groups (of at least sub_group_size elements) on the GPU: 1e8 splits a 7B
            # model's optimizer in about 1.5% steps (1e9, its default, in 15%), and the GPU's AdamW step needs
            # one sub-group of scratch space
            zero["offload_optimizer"]["ratio"] = s.offload_optimizer_ratio
            zero["sub_group_size"] = GPU_SHARE_SUB_GROUP
    if s.offload_param != "none":
        zero["offload_param"] = _offload_block(s.offload_param, s.nvme_path, pin)
    if s.zero_stage == 3:
        # Lets DeepSpeed's save_16bit_model (a user's own call on the engine) gather full weights, not empty shards
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds["zero_optimization"] = zero
    if s.fast_path:
        fast_path(ds, device, world_size)
    return ds


def fast_path(ds: dict[str, Any], device: str, world_size: int) -> None:
    """Rewrite a generated config (in place) so DeepSpeed's step costs what plain PyTorch's does.

    Measured on one H100 at BERT-base shape (BENCHMARKS.md): DeepSpeed 0.19's default step is
    bound by the host, with one host-device synchronisation per parameter tensor. Each change below
    removes a cost and keeps the arithmetic of a plain PyTorch step:

    * ``timers.throughput`` off: DeepSpeed synchronises the device twice per micro-batch for a
      throughput figure it only prints; zerotrain measures throughput itself.
    * ZeRO-0 in bf16 runs as ``torch_autocast`` (fp32 weights, bf16 matmuls), not the ``bf16`` block.
      At stage 0 that block runs DeepSpeed's FP16_Optimizer, which checks every gradient tensor for
      overflow on the host (~160 syncs a step) and takes one zero-gradient Adam step at start-up, so
      its first real update is ~0.74x plain Adam's. Autocast is what the plain engine does.
    * ZeRO-0 without fp16: the engine clips (one fused ``clip_grad_norm_`` that stays on the device,
      see :func:`engine_clips`) instead of DeepSpeed's per-tensor clip, which synchronises twice.
    * ZeRO-1/2 in bf16: no overflow check (``bf16.check_grad_overflow``). bf16 has fp32's range and
      no loss scale to adjust; plain PyTorch does not skip such steps either.
    * ZeRO-1/2: ``contiguous_gradients`` off. On, each gradient is copied into a reduce bucket as it
      arrives and again into the partition after the reduce: two copies and their bookkeeping per
      parameter tensor, on the host (~0.04 ms a tensor on the CPU, 20-25% of ZeRO-1/2's step there).
      Off, the gradients are flattened for the same all-reduce: the same arithmetic, the same
      checkpoints, and no 5e8-element bucket allocated each step. (DeepSpeed wants it on for MoE,
      which zerotrain does not build, and turns it back on under optimizer offload, so it is left
      alone there.) A ``--strategy.contiguous_gradients true`` is overridden too: ``false`` here
      changes no result, only speed.

    More fixes are not config keys and so also apply to a user's own JSON (the engine applies them):
    under ZeRO-1/2 with CPU optimizer offload the gradient norm is read to the host once a step, not
    once per gradient tensor; ZeRO-1/2 clip without reading the norm to the host and mask an invalid
    norm without the two waits DeepSpeed's mask makes; ZeRO-1/2's per-tensor host work is cut (the norm
    in one launch, no re-pointing of weights that have not moved, on one rank no reduction, the identity
    there). Each is a declared patch in :mod:`zerotrain.engines.ds_private.patches`, applied only on the
    DeepSpeed versions it was verified on.
    """
    ds["timers"] = {"throughput": {"enabled": False}}
    stage = ds["zero_optimization"]["stage"]
    bf16 = _enabled(ds.get("bf16"))
    if stage == 0 and bf16 and device == "cuda":
        ds["bf16"] = {"enabled": False}
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif stage in (1, 2) and bf16:
        ds["bf16"]["check_grad_overflow"] = False
    if stage in (1, 2) and _offload_device(ds["zero_optimization"].get("offload_optimizer")) in (None, "none"):
        ds["zero_optimization"]["contiguous_gradients"] = False
    if stage == 0 and not _enabled(ds.get("fp16")):
        ds["gradient_clipping"] = 0.0  # the engine clips instead


def engine_clips(cfg: RunConfig, ds: dict[str, Any]) -> bool:
    """Whether the engine, not DeepSpeed, clips gradients: generated fast-path configs at ZeRO-0
    without fp16 (where the full gradients sit in ``.grad`` after backward, as in plain PyTorch)."""
    return (cfg.strategy.fast_path and not cfg.strategy.deepspeed_config
            and ds["zero_optimization"]["stage"] == 0 and not _enabled(ds.get("fp16")))


def load_user_config(path: str | Path) -> dict[str, Any]:
    """Read a DeepSpeed config file: JSON, or HJSON with ``#`` / ``//`` comments as DeepSpeed allows."""
    import hjson

    p = Path(path).expanduser()
    flag = "--strategy.deepspeed_config"
    if not p.is_file():
        raise UserError(f"{flag}: file {str(p)!r} not found. Pass the path of a DeepSpeed JSON file, "
                        "e.g. one of the presets in zerotrain/presets/")
    try:
        text = p.read_text()
        loaded = hjson.loads(text, object_pairs_hook=dict)
    except Exception as exc:  # hjson raises its own HjsonDecodeError with line/column
        raise UserError(f"{flag}: {p} is not valid JSON/HJSON: {exc}") from None
    if not isinstance(loaded, dict) or not _opens_an_object(text):
        raise UserError(f"{flag}: {p} must hold one JSON object ({{...}}) at the top level"
                        + (" (it reads as YAML: write the file as JSON)" if isinstance(loaded, dict) else ""))
    check_user_keys(loaded, p)
    check_user_types(loaded, p)
    check_user_features(loaded, p)
    return loaded


def _opens_an_object(text: str) -> bool:
    """Whether a JSON/HJSON text starts with ``{`` after comments: HJSON also reads a brace-less body, which is how a
    YAML file given by mistake parses (into other values than YAML's)."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "//")):
            return stripped.startswith("{")
    return False


_TOP_LEVEL_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "steps_per_print"), (int,)),
    **dict.fromkeys(("gradient_clipping", "gradient_predivide_factor"), (int, float)),
    **dict.fromkeys(("wall_clock_breakdown", "prescale_gradients", "sparse_gradients", "zero_allow_untested_optimizer",
                     "zero_force_ds_cpu_optimizer", "dump_state", "memory_breakdown", "dataloader_drop_last",
                     "disable_allgather", "use_data_before_expert_parallelism", "use_node_local_storage",
                     "graph_harvesting"), (bool,)),
    **dict.fromkeys(("communication_data_type", "seq_parallel_communication_data_type"), (str, type(None))),
}
"""The types of DeepSpeed's top-level scalar keys, which DeepSpeed reads without a config model; every other
documented top-level key holds an object."""

_AT_LEAST = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "steps_per_print": 1, "gradient_clipping": 0, "gradient_predivide_factor": 0}
_COMM_TYPES = ("fp32", "fp16", "bf16")
"""What DeepSpeed's communication_data_type accepts (its ZeRO reductions run in one of these)."""


def check_user_types(user: dict[str, Any], path: str | Path) -> None:
    """Refuse, in one line naming the key, the value and the type expected, a value of a user's DeepSpeed file that
    DeepSpeed would read as another type or refuse deep in ``deepspeed.initialize``: the top-level scalars against
    their types above, the ``zero_optimization``, ``fp16`` and ``bf16`` blocks against DeepSpeed's own config models
    (:func:`zerotrain.engines.ds_private.config.block_type_error`), optimizer and scheduler types against the ones
    DeepSpeed builds. ``"auto"`` stands for any value (zerotrain fills it)."""

    def refuse(key: str, value: Any, expected: str) -> UserError:
        shown = json.dumps(value, default=str)
        return UserError(f"--strategy.deepspeed_config: {path}: {key} is {shown}, but DeepSpeed expects {expected}")

    for key, value in user.items():
        if value == "auto" or str(key).startswith("_"):
            continue
        types = _TOP_LEVEL_TYPES.get(key, (dict,))
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if int in types and float not in types and isinstance(value, float) and value.is_integer():
            wrong = False  # 1e3: a whole number, as JSON may write it
        if wrong:
            expected = {(int,): "an integer", (int, float): "a number", (bool,): "true or false",
                        (str, type(None)): "a string or null", (dict,): "an object ({...})"}[types]
            raise refuse(key, value, expected)
        if key in _AT_LEAST and value < _AT_LEAST[key]:
            raise refuse(key, value, f"a value >= {_AT_LEAST[key]}")
        if key in ("communication_data_type", "seq_parallel_communication_data_type") and value not in (None, *_COMM_TYPES):
            raise refuse(key, value, "one of " + ", ".join(f'"{t}"' for t in _COMM_TYPES) + " or null")
        if key in ("zero_optimization", "fp16", "bf16"):
            found = block_type_error(key, value)
            if found is not None and found[0] == key:  # DeepSpeed's check of the whole block, in its own words
                raise UserError(f"--strategy.deepspeed_config: {path}: DeepSpeed refuses its {key} block "
                                f"{json.dumps(found[1], default=str)}: \"{found[2].rstrip('.')}\". Edit that block of "
                                "the file as DeepSpeed's sentence says")
            if found is not None:
                raise refuse(*found)
    for block, known in (("optimizer", None), ("scheduler", builtin_scheduler_names())):
        spec = user.get(block)
        if not isinstance(spec, dict):
            continue
        name, params = spec.get("type"), spec.get("params", {})
        if "type" in spec and not isinstance(name, str):
            raise refuse(f"{block}.type", name, "a string (the name of one of DeepSpeed's)")
        if not isinstance(params, dict) and params != "auto":
            raise refuse(f"{block}.params", params, "an object ({...})")
        if known is not None and isinstance(name, str) and name not in known:
            raise refuse(f"{block}.type", name, "one of " + ", ".join(sorted(known)))


def check_user_features(user: dict[str, Any], path: str | Path) -> None:
    """Refuse, in one line, a DeepSpeed feature under which a run could not keep zerotrain's promises.

    SuperOffload (``zero_optimization.offload_optimizer.super_offload``, DeepSpeed 0.19) steps CPU Adam in a worker
    process of its own, which holds Adam's moments: DeepSpeed's checkpoint saves the optimizer of the training
    process, which has none, so a resume would restart the moments at zero. A run with it on an H100 also did not
    exit after training.

    bf16 master weights (``bf16.bf16_master_weights_and_grads``) with the optimizer on NVMe: DeepSpeed 0.19.8
    sizes its swap buffers in bf16 and swaps fp32 masters through them, and stops at the first step."""
    zero = user.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    bf16 = user.get("bf16")
    if (isinstance(offload, dict) and offload.get("device") == "nvme" and _enabled(bf16)
            and bf16.get("bf16_master_weights_and_grads") is True):
        raise UserError(f"--strategy.deepspeed_config: {path}: bf16.bf16_master_weights_and_grads is true beside "
                        "zero_optimization.offload_optimizer.device nvme, which DeepSpeed 0.19 stops at on the first "
                        "step (its swap buffers take bf16, the master weights it swaps stay fp32): drop "
                        "bf16_master_weights_and_grads (and bf16_optimizer_states), or offload the optimizer to cpu")
    if isinstance(offload, dict) and offload.get("super_offload") is True:
        raise UserError(f"--strategy.deepspeed_config: {path}: zero_optimization.offload_optimizer.super_offload is "
                        "true, which zerotrain refuses: SuperOffload keeps Adam's moments in a worker process that "
                        "DeepSpeed's checkpoints do not save (a resume would restart them at zero). Drop it; to keep "
                        "the GPU busier while the optimizer steps on the host, accumulate more micro-batches a step "
                        "(--strategy.gradient_accumulation_steps, or gradient_accumulation_steps in the file)")


# DeepSpeed's documented top-level keys (deepspeed.ai/docs/config-json). DeepSpeed reads the keys it
# knows and ignores the rest, so a misspelt block (zero_optimisation) silently runs with defaults.
DS_TOP_LEVEL_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler fp16 bf16
torch_autocast amp gradient_clipping prescale_gradients gradient_predivide_factor sparse_gradients
zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print wall_clock_breakdown
dump_state flops_profiler activation_checkpointing aio sparse_attention data_efficiency curriculum_learning
tensorboard wandb csv_monitor comet elasticity checkpoint data_types communication_data_type
seq_parallel_communication_data_type autotuning compression_training memory_breakdown timers pipeline
comms_logger disable_allgather dataloader_drop_last nebula weight_quantization hybrid_engine eigenvalue
progressive_layer_drop quantize_training use_data_before_expert_parallelism use_node_local_storage
graph_harvesting compile tensor_parallel
""".split())

# Blocks DeepSpeed reads only inside another one: at the top level they would be ignored as silently as a typo.
NESTED_KEYS = {"zenflow": "zero_optimization.zenflow", "offload_optimizer": "zero_optimization.offload_optimizer",
               "offload_param": "zero_optimization.offload_param", "stage": "zero_optimization.stage",
               "gradient_accumulation_dtype": "data_types.grad_accum_dtype",
               "grad_accum_dtype": "data_types.grad_accum_dtype"}


def _zero_keys() -> frozenset[str]:
    """zero_optimization's keys, from DeepSpeed's own config model (field names and their stage3_ aliases)."""
    # Deferred: zerotrain.engines imports this module (a circle at import time), and it imports DeepSpeed

    keys = zero_optimization_keys()
    if keys is not None:
        return keys
    # another DeepSpeed layout: the keys zerotrain itself writes and documents
    return frozenset("""stage overlap_comm contiguous_gradients reduce_bucket_size allgather_bucket_size
            allgather_partitions reduce_scatter offload_optimizer offload_param sub_group_size round_robin_gradients
            stage3_prefetch_bucket_size stage3_param_persistence_threshold stage3_max_live_parameters
            stage3_max_reuse_distance stage3_gather_16bit_weights_on_model_save""".split())


def check_user_keys(user: dict[str, Any], path: str | Path) -> None:
    """Refuse a key DeepSpeed would ignore, naming it and the closest valid key (keys starting with _ are comments)."""
    import difflib

    flag = "--strategy.deepspeed_config"
    zero = user.get("zero_optimization")
    for prefix, keys, valid in (("", user, DS_TOP_LEVEL_KEYS),
                                ("zero_optimization.", zero if isinstance(zero, dict) else {}, _zero_keys())):
        for key in keys:
            if key in valid or str(key).startswith("_"):
                continue
            close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.6)
            if not prefix and key in NESTED_KEYS:
                hint = f"DeepSpeed reads it as {NESTED_KEYS[key]}: move it there"
            elif close:
                hint = f"did you mean {prefix}{close[0]}?"
            else:
                hint = "see https://www.deepspeed.ai/docs/config-json/"
            raise UserError(f"{flag}: {path}: unknown key {prefix}{key} (DeepSpeed would ignore it): {hint}")


# Keys whose "auto" is not the same key in the generated config (Hugging Face's conventions).
def _auto_aliases(generated: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    zero = generated["zero_optimization"]
    aliases: dict[str, Any] = {
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.cos_min_ratio": extra.get("min_lr_ratio", 0.0),
        "zero_optimization.stage3_prefetch_bucket_size": zero["reduce_bucket_size"],
        "zero_optimization.stage3_param_persistence_threshold": 100_000,
        "zero_optimization.allgather_bucket_size": 500_000_000,
        "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
        "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    }
    if "optimizer" in generated:
        aliases["scheduler.params.warmup_max_lr"] = generated["optimizer"]["params"]["lr"]
    # The flags' own values, for keys the config generated at the flags' stage lacks (the file decides the stage)
    aliases.update(extra.get("flags", {}))
    if "hidden_size" in extra:
        h = extra["hidden_size"]
        # Hugging Face's rule of thumb: buckets sized from the hidden size.
        aliases["zero_optimization.reduce_bucket_size"] = h * h
        aliases["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        aliases["zero_optimization.stage3_param_persistence_threshold"] = 10 * h
    for key in ("warmup_num_steps", "total_num_steps"):
        if key in extra:
            aliases[f"scheduler.params.{key}"] = extra[key]
    return aliases


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def resolve_auto(user: dict[str, Any], generated: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill every ``"auto"`` in ``user`` from ``generated`` (same key) or a known alias; keep explicit values.

    ``extra`` carries facts DeepSpeed JSON does not hold: ``total_num_steps``, ``warmup_num_steps``,
    ``min_lr_ratio``, ``hidden_size``, and ``flags`` (:func:`flag_settings`). Top-level keys the loop needs (batch
    sizes, accumulation) are taken from ``generated`` when the user's file lacks them. An ``"auto"`` nobody can fill is an
    error naming its key.
    """
    aliases = _auto_aliases(generated, extra or {})

    def fill(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {k: fill(v, f"{path}.{k}" if path else k) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if node != "auto":
            return node
        try:
            value = _lookup(generated, path)
        except KeyError:
            if path in aliases:
                return copy.deepcopy(aliases[path])
            raise ConfigError(
                path, '= "auto" cannot be resolved from the zerotrain config: write an explicit value in '
                "the file given to --strategy.deepspeed_config"
            ) from None
        return copy.deepcopy(value)

    resolved = fill(user, "")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "steps_per_print"):
        resolved.setdefault(key, generated[key])
    # An "auto" (or absent) train_batch_size follows the file's own micro-batch and accumulation, which
    # may be explicit and differ from the typed config's.
    micro, gas = resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"]
    if user.get("train_batch_size", "auto") == "auto" and isinstance(micro, int) and isinstance(gas, int):
        world = generated["train_batch_size"] // (
            generated["train_micro_batch_size_per_gpu"] * generated["gradient_accumulation_steps"])
        resolved["train_batch_size"] = micro * gas * world
    if "optimizer" not in resolved and "optimizer" in generated:
        resolved["optimizer"] = copy.deepcopy(generated["optimizer"])
    for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
        if key in generated and key not in user:
            resolved[key] = generated[key]
    scheduler = resolved.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type") == "WarmupCosineLR" \
            and _lookup_or(user, "scheduler.params.warmup_num_steps") == "auto" \
            and scheduler.get("params", {}).get("warmup_num_steps") == 0:
        # DeepSpeed's WarmupCosineLR refuses 0 (it warms up over at least 2 steps whatever it is given): without
        # --scheduler.warmup_steps the shortest warm-up it accepts.
        scheduler["params"]["warmup_num_steps"] = 1
    return resolved


def _lookup_or(tree: dict[str, Any], dotted: str) -> Any:
    try:
        return _lookup(tree, dotted)
    except KeyError:
        return None


FLAG_KEYS = (("optimizer", "lr", "optimizer.params.lr"), ("optimizer", "betas", "optimizer.params.betas"),
             ("optimizer", "eps", "optimizer.params.eps"), ("optimizer", "weight_decay", "optimizer.params.weight_decay"),
             ("trainer", "micro_batch_size", "train_micro_batch_size_per_gpu"),
             ("strategy", "gradient_accumulation_steps", "gradient_accumulation_steps"),
             ("strategy", "gradient_clipping", "gradient_clipping"), ("strategy", "zero_stage", "zero_optimization.stage"),
             ("strategy", "overlap_comm", "zero_optimization.overlap_comm"),
             ("strategy", "reduce_bucket_size", "zero_optimization.reduce_bucket_size"),
             ("strategy", "allgather_bucket_size", "zero_optimization.allgather_bucket_size"),
             ("strategy", "offload_optimizer_ratio", "zero_optimization.offload_optimizer.ratio"))
"""(section, field, DeepSpeed key): the flags a user's DeepSpeed file can also set."""


def flag_settings(cfg: RunConfig) -> dict[str, Any]:
    """Each :data:`FLAG_KEYS` DeepSpeed key with its flag's value: what a user file's ``"auto"`` there stands for."""
    values = {key: getattr(getattr(cfg, section), name) for section, name, key in FLAG_KEYS}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


_ABSENT = object()


def _setting(user: dict[str, Any], dotted: str) -> Any:
    """The file's value at ``dotted``: ``"auto"`` where the key or a block above it is ``"auto"`` (zerotrain fills
    the whole of such a block), :data:`_ABSENT` where the file does not set it."""
    node: Any = user
    for part in dotted.split("."):
        if node == "auto":
            return "auto"
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _deepspeed_default_agrees(user: dict[str, Any], key: str, value: Any, flag_stage: int) -> bool:
    """Whether DeepSpeed, left to its default for ``key`` under the file's ``zero_optimization`` block, runs as the flag
    ``value`` asks: its own default is that value (``overlap_comm`` is on at stage 3), or it does not read the key at the
    file's stage (``allgather_bucket_size`` outside stages 1 and 2). A stage the file leaves to ``"auto"`` is
    ``flag_stage``, --strategy.zero_stage, which fills it."""
    if not key.startswith("zero_optimization."):
        return False
    zero = user.get("zero_optimization") if isinstance(user.get("zero_optimization"), dict) else {}
    zero = {k: v for k, v in zero.items() if v is not None}
    if zero.get("stage") == "auto":
        zero["stage"] = flag_stage
    field = key.removeprefix("zero_optimization.")
    if field == "allgather_bucket_size" and zero.get("stage", 0) not in (1, 2):
        return True
    return zero_default(zero, field) == value


FILLED_WHEN_ABSENT = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""Keys of :data:`FLAG_KEYS` that :func:`resolve_auto` takes from the flags when a user's file leaves them out (the
``optimizer`` block too, when the file has none)."""


def check_flags_agree(cfg: RunConfig, user: dict[str, Any], path: str) -> None:
    """Refuse, in one line naming both, a flag that a user's DeepSpeed file sets to another value, or leaves to
    DeepSpeed's default: the file would win without a word (the Hugging Face Trainer refuses such a mismatch too). A
    flag at its default counts as not given, so the file decides; a file's ``"auto"`` is filled from the flag, and so
    are the keys the file may leave out (:data:`FILLED_WHEN_ABSENT`). Offload and precision are checked by their own
    rules (:func:`_check_pinning_agrees`, the file's blocks decide)."""
    asked, theirs = cfg.optimizer.name, _setting(user, "optimizer.type")
    row = optimizers.kind(asked) if asked != type(cfg.optimizer)().name else None
    if row is not None and isinstance(theirs, str) and theirs != "auto" and theirs.lower() != row.ds_type.lower():
        raise ConfigError("--optimizer.name", f"is {asked}, but {path} (--strategy.deepspeed_config) sets optimizer.type "
                          f"to {json.dumps(theirs)}, and the file would win: drop the flag, or write "
                          f'"type": "{row.ds_type}" there')
    for section_name, name, key in FLAG_KEYS:
        section = getattr(cfg, section_name)
        value = getattr(section, name)
        if value == getattr(type(section)(), name):
            continue
        mine = list(value) if isinstance(value, tuple) else value
        theirs = _setting(user, key)
        if theirs is _ABSENT or theirs is None:  # DeepSpeed reads null as its default too
            if (key in FILLED_WHEN_ABSENT or (key.startswith("optimizer.") and "optimizer" not in user)
                    or _deepspeed_default_agrees(user, key, mine, cfg.strategy.zero_stage)):
                continue
            flag = f"--{section_name}.{name}"
            if key == "zero_optimization.offload_optimizer.ratio" and not isinstance(
                    (user.get("zero_optimization") or {}).get("offload_optimizer"), dict):
                raise ConfigError(flag, f"is {json.dumps(mine)}, but {path} (--strategy.deepspeed_config) decides and "
                                  "does not offload the optimizer: give its zero_optimization block stage 3 and "
                                  f'"offload_optimizer": {{"device": "cpu", "ratio": {json.dumps(mine)}}}, or drop the flag')
            raise ConfigError(flag, f"is {json.dumps(mine)}, but {path} "
                              f"(--strategy.deepspeed_config) decides and does not set {key}, so DeepSpeed's default "
                              f"would apply: write {json.dumps(mine)} (or \"auto\") there, or drop the flag")
        if theirs == "auto":
            continue
        if theirs != mine:
            raise ConfigError(f"--{section_name}.{name}", f"is {json.dumps(mine)}, but {path} "
                              f"(--strategy.deepspeed_config) sets {key} to {json.dumps(theirs)}, and the file would "
                              f"win: drop the flag, or write {json.dumps(mine)} (or \"auto\") there")


def validate_ds_config(ds: dict[str, Any], world_size: int, device: str | None = None) -> None:
    """Check what DeepSpeed would reject late or silently: batch rule, fp16+bf16, offload vs stage; with
    ``device``, precision the device cannot run, an optimizer DeepSpeed does not have, blocks zerotrain ignores."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    gas = ds.get("gradient_accumulation_steps")
    total = ds.get("train_batch_size")
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas),
                       ("train_batch_size", total)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(key, f"must be a positive integer, got {value!r}")
    if micro * gas * world_size != total:
        raise ConfigError(
            "train_batch_size",
            f"= {total}, but train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size = "
            f"{micro} x {gas} x {world_size} = {micro * gas * world_size}. Make them agree "
            "(or write \"auto\" for train_batch_size)",
        )
    if _enabled(ds.get("fp16")) and _enabled(ds.get("bf16")):
        raise ConfigError("fp16.enabled", "and bf16.enabled are both true: pick one precision")
    zero = ds.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage!r}")
    if _offload_device(zero.get("offload_param")) not in (None, "none") and stage != 3:
        raise ConfigError("zero_optimization.offload_param", f"needs stage 3, but zero_optimization.stage is {stage}")
    if _offload_device(zero.get("offload_optimizer")) not in (None, "none") and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer", "needs stage 1, 2 or 3, but zero_optimization.stage is 0")
    if device is not None:
        _validate_for_device(ds, device)


# DeepSpeed's built-in optimizers (its DEEPSPEED_OPTIMIZERS, lower case); others need a client optimizer.
_DS_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion", "muadam",
                  "muadamw", "musgd", "muon", "cpu_adam", "cpu_adagrad", "cpu_lion", "fusedadam")


def _validate_for_device(ds: dict[str, Any], device: str) -> None:
    import difflib

    if _enabled(ds.get("fp16")) and device == "cpu":
        raise ConfigError("fp16.enabled", "= true needs a GPU (as --precision.dtype fp16 does); on CPU set "
                          "\"fp16\": {\"enabled\": false} in the file given to --strategy.deepspeed_config, or use bf16")
    if "activation_checkpointing" in ds:
        # That block configures DeepSpeed's activation-checkpointing API, which only models calling it use; zerotrain's
        # models recompute through torch.utils.checkpoint, switched by the flag.
        raise ConfigError("activation_checkpointing", "(a block of the file given to --strategy.deepspeed_config) "
                          "does nothing for zerotrain's models: remove it and pass --activation_checkpointing.enabled true")
    opt = ds.get("optimizer")
    name = opt.get("type") if isinstance(opt, dict) else None
    if isinstance(name, str) and name.lower() not in _DS_OPTIMIZERS \
            and name not in {row.ds_type for row in optimizers.OPTIMIZERS.values()}:  # DeepSpeed: torch.optim.<type>
        # Deferred: zerotrain.engines imports this module (a circle at import time), and it imports DeepSpeed

        known = sorted(set(builtin_optimizer_names() or ()) | set(_DS_OPTIMIZERS))
        if name.lower() not in known:
            close = difflib.get_close_matches(name.lower(), known, n=1)
            raise ConfigError("optimizer.type", f"= {name!r} is not a DeepSpeed optimizer"
                              + (f": did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"))


REFLECTED = frozenset({"precision.dtype", "strategy.zero_stage", "strategy.offload_optimizer",
                       "strategy.offload_optimizer_ratio", "strategy.offload_param",
                       "strategy.offload_pin_memory", "strategy.overlap_comm", "strategy.contiguous_gradients",
                       "strategy.reduce_bucket_size", "strategy.allgather_bucket_size", "trainer.micro_batch_size",
                       "strategy.gradient_accumulation_steps", "strategy.gradient_clipping", "optimizer.lr",
                       "optimizer.eps", "optimizer.weight_decay", "optimizer.betas", "optimizer.name",
                       "optimizer.momentum", "precision.master_weights", "precision.optimizer_states"})
"""The settings :func:`reflect_ds_config` writes: with a user's DeepSpeed file, known only once it is resolved."""


def reflect_ds_config(cfg: RunConfig, ds: dict[str, Any], precision: str) -> None:
    """Write into ``cfg`` (the run's resolved copy) what a user's DeepSpeed file set, so ``hparams.json``
    records the settings the run used rather than the typed config the file overrode."""
    s, zero = cfg.strategy, ds.get("zero_optimization") or {}
    cfg.precision.dtype = precision
    cfg.precision.master_weights, cfg.precision.optimizer_states = state_precision(ds)  # type: ignore[assignment]
    s.zero_stage = zero.get("stage", 0)
    for name in ("offload_optimizer", "offload_param"):
        device = _offload_device(zero.get(name))
        setattr(s, name, device if device in ("cpu", "nvme") else "none")
    ratio = (zero.get("offload_optimizer") or {}).get("ratio", 1.0)
    shared = s.zero_stage == 3 and s.offload_optimizer == "cpu" and isinstance(ratio, (int, float))
    s.offload_optimizer_ratio = float(ratio) if shared else 1.0
    offloads = [zero[name] for name in ("offload_optimizer", "offload_param")
                if _offload_device(zero.get(name)) in ("cpu", "nvme")]
    # The file's pin_memory, not --strategy.offload_pin_memory, is what DeepSpeed ran with (its default: false).
    # Blocks that differ have no one value: unset, as the flag must be for that file (_check_pinning_agrees
    # refuses any value there), so the recorded config reruns; ds_config.json beside it holds each block's.
    pins = {bool(block.get("pin_memory", False)) for block in offloads}
    s.offload_pin_memory = pins.pop() if len(pins) == 1 else None
    for name in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"):
        if isinstance(zero.get(name), (bool, int)):
            setattr(s, name, zero[name])
    cfg.trainer.micro_batch_size = ds["train_micro_batch_size_per_gpu"]
    s.gradient_accumulation_steps = ds["gradient_accumulation_steps"]
    if isinstance(ds.get("gradient_clipping"), (int, float)):
        s.gradient_clipping = float(ds["gradient_clipping"])
    params = (ds.get("optimizer") or {}).get("params") or {}
    o = cfg.optimizer
    row = optimizers.by_ds_type((ds.get("optimizer") or {}).get("type", ""))
    if row is not None:
        o.name = "adamw" if row.name == "adam" and bool(params.get("adam_w_mode", True)) else row.name
    for name, cast in (("lr", float), ("eps", float), ("weight_decay", float), ("momentum", float)):
        if isinstance(params.get(name), (int, float)):
            setattr(o, name, cast(params[name]))
    if isinstance(params.get("betas"), list) and len(params["betas"]) == 2:
        o.betas = tuple(params["betas"])


def _enabled(block: Any) -> bool:
    return isinstance(block, dict) and block.get("enabled") is True


def check_nvme_io(cfg: RunConfig) -> None:
    """Refuse an NVMe offload where DeepSpeed's async I/O op cannot be built, before anything is loaded or built.

    DeepSpeed reads and writes NVMe-offloaded tensors through that op, compiled on first use against libaio.
    Without libaio it fails deep inside ``deepspeed.initialize``, after the data and the model (minutes for a
    model that needs NVMe), with a traceback that names neither the flag nor the fix; this says both."""
    s = cfg.strategy
    if s.backend != "deepspeed":
        return
    keys = ("offload_optimizer", "offload_param")
    if s.deepspeed_config:  # the file's offload blocks decide
        zero = load_user_config(s.deepspeed_config).get("zero_optimization", {})
        nvme = [key for key in keys if _offload_device(zero.get(key)) == "nvme"]
    else:
        nvme = [key for key in keys if getattr(s, key) == "nvme"]
    if not nvme:
        return

    status = nvme_offload_status()
    if status == "ready":
        return
    flag, what = ((f"--strategy.deepspeed_config {s.deepspeed_config}", f"(zero_optimization.{nvme[0]}.device nvme)")
                  if s.deepspeed_config else (f"--strategy.{nvme[0]}", "nvme"))
    raise ConfigError(flag, f"{what}: DeepSpeed's async I/O op, which NVMe offload needs, cannot be built here: "
                            f"NVMe offload {status}. Or offload to cpu; `zerotrain doctor` shows the "
                            "op's state")


def _offload_device(block: Any) -> str | None:
    return block.get("device") if isinstance(block, dict) else None


def precision_of(ds: dict[str, Any]) -> ResolvedPrecision:
    """The precision a (resolved) DeepSpeed config trains in."""
    autocast = ds.get("torch_autocast")
    if _enabled(ds.get("bf16")) or (_enabled(autocast) and autocast.get("dtype") in ("bfloat16", "torch.bfloat16")):
        return "bf16"
    if _enabled(ds.get("fp16")):
        return "fp16"
    return "fp32"


def batch_shape(cfg: RunConfig) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) the run will use: the user's file wins where it is explicit."""
    micro, gas = cfg.trainer.micro_batch_size, cfg.strategy.gradient_accumulation_steps
    if cfg.strategy.backend == "deepspeed" and cfg.strategy.deepspeed_config:
        user = load_user_config(cfg.strategy.deepspeed_config)
        check_flags_agree(cfg, user, cfg.strategy.deepspeed_config)
        micro = user.get("train_micro_batch_size_per_gpu", micro)
        gas = user.get("gradient_accumulation_steps", gas)
        micro = cfg.trainer.micro_batch_size if micro == "auto" else micro
        gas = cfg.strategy.gradient_accumulation_steps if gas == "auto" else gas
    return micro, gas


def make_ds_config(cfg: RunConfig, world_size: int, device: str, precision: ResolvedPrecision,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config DeepSpeed gets: generated, or the user's file with "auto" resolved; always validated."""
    if cfg.strategy.deepspeed_config:
        # The user's file decides the stage and precision blocks, so its "auto" values are filled from
        # DeepSpeed's defaults for the typed config, not from a fast path planned for another stage.
        plain = dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, fast_path=False))
        generated = build_ds_config(plain, world_size, device, precision)
        user = load_user_config(cfg.strategy.deepspeed_config)
        check_flags_agree(cfg, user, cfg.strategy.deepspeed_config)
        # An "auto" precision flag follows the resolved precision of the typed config.
        ds = resolve_auto(user, generated, {**(extra or {}), "flags": flag_settings(cfg)})
        _check_pinning_agrees(ds, cfg.strategy.offload_pin_memory, cfg.strategy.deepspeed_config)
        _check_gpu_share(ds, cfg.strategy.deepspeed_config, "optimizer" in user,
                         _setting(user, "zero_optimization.offload_optimizer.ratio") == "auto")
        _check_state_precision_agrees(ds, cfg.precision.master_weights, cfg.precision.optimizer_states,
                                      cfg.strategy.deepspeed_config)
        if "optimizer" in user and "optimizer" not in generated:
            raise ConfigError("--optimizer.name", f"{cfg.optimizer.name} and the optimizer block of "
                              f"{cfg.strategy.deepspeed_config} (--strategy.deepspeed_config) both name an optimizer: "
                              "remove the block, or leave --optimizer.name unset")
    else:
        ds = build_ds_config(cfg, world_size, device, precision)
    _size_param_swap_buffers(ds, (extra or {}).get("largest_param_numel"), world_size, cfg.strategy.deepspeed_config)
    path = cfg.strategy.deepspeed_config
    _no_reuse_of_nvme_weights(ds, (load_user_config(path).get("zero_optimization") or {}) if path else None)
    if (extra or {}).get("nvme_folder") and not cfg.strategy.deepspeed_config:
        for name in ("offload_optimizer", "offload_param"):
            block = ds["zero_optimization"].get(name)
            if isinstance(block, dict) and block.get("device") == "nvme":
                block["nvme_path"] = extra["nvme_folder"]
    validate_ds_config(ds, world_size, device)
    s, stage = cfg.strategy, (ds.get("zero_optimization") or {}).get("stage", 0)
    if cfg.compile.enabled and cfg.compile.mode == "reduce-overhead" and stage != 3 \
            and ds["gradient_accumulation_steps"] > 1:
        # config.check_across_sections refuses the flags; a user's file can still set accumulation. Refused on a CPU
        # too, as the flags are, so that a config that runs here runs on a GPU.
        raise ConfigError("gradient_accumulation_steps", f"= {ds['gradient_accumulation_steps']} in "
                          f"{s.deepspeed_config}, but CUDA graphs (--compile.mode reduce-overhead) would "
                          "overwrite the gradients accumulated so far: set it to 1 or --compile.mode default")
    return ds


def state_precision(ds: dict[str, Any]) -> tuple[str, str]:
    """(master weights, optimizer states) precision of a DeepSpeed config: bf16 where its enabled ``bf16`` block
    sets ``bf16_master_weights_and_grads`` / ``bf16_optimizer_states``, else fp32."""
    bf16 = ds.get("bf16") if _enabled(ds.get("bf16")) else {}
    master = "bf16" if bf16.get("bf16_master_weights_and_grads") is True else "fp32"
    states = "bf16" if master == "bf16" and bf16.get("bf16_optimizer_states") is True else "fp32"
    return master, states


def _check_state_precision_agrees(ds: dict[str, Any], master: str, states: str, path: str) -> None:
    """A user's file decides the precision of its master weights and optimizer states; a bf16 flag that the file
    does not say too would be dropped without a word, so it is refused instead (fp32, the default, is no request)."""
    ran = state_precision(ds)
    for flag, asked, key, got in (("--precision.master_weights", master, "bf16_master_weights_and_grads", ran[0]),
                                  ("--precision.optimizer_states", states, "bf16_optimizer_states", ran[1])):
        if asked == "bf16" and got != "bf16":
            raise ConfigError(flag, f"is bf16, but {path} (--strategy.deepspeed_config) decides and does not set "
                              f"bf16.{key}: set it to true there (with bf16.enabled), or leave {flag} unset")


def _check_gpu_share(ds: dict[str, Any], path: str, users_optimizer: bool = True, ratio_from_flag: bool = False) -> None:
    """Refuse, in one line naming the file, a user's ``offload_optimizer.ratio`` below 1 where DeepSpeed 0.19 would not
    split the optimizer as asked.

    DeepSpeed splits it only at ZeRO-3 with the optimizer on the cpu (it ignores the ratio elsewhere); it does not
    build the split beside weights on NVMe (their swapped masters live on the host); and it steps the GPU's share with
    torch's AdamW in the master weights' dtype, so the host's optimizer must be AdamW (Adam with ``adam_w_mode``) and
    the master weights fp32 for the states to be what the file says. ``users_optimizer``: the file has an
    ``optimizer`` block (else --optimizer.name made it, and the line names the flag); ``ratio_from_flag``: the file's
    ratio is ``"auto"``, filled from --strategy.offload_optimizer_ratio (the line names both)."""
    zero = ds.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    ratio = offload.get("ratio", 1.0)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio >= 1.0:
        return  # a --strategy.offload_optimizer_ratio the file leaves out or contradicts: check_flags_agree
    said = f"--strategy.deepspeed_config: {path}: zero_optimization.offload_optimizer.ratio is {ratio}" + (
        ' ("auto", from --strategy.offload_optimizer_ratio)' if ratio_from_flag else "")
    if zero.get("stage") != 3 or offload.get("device") != "cpu":
        raise UserError(f"{said}, but DeepSpeed splits the optimizer between the host and the GPU only at stage 3 with "
                        "the optimizer's device cpu. Set those, or drop the ratio")
    if _offload_device(zero.get("offload_param")) == "nvme":
        raise UserError(f"{said} beside zero_optimization.offload_param on nvme, which DeepSpeed 0.19 does not build: "
                        "put the weights on the cpu or the GPU, or drop the ratio")
    if _enabled(ds.get("bf16")) and ds["bf16"].get("bf16_master_weights_and_grads") is True:
        raise UserError(f"{said} beside bf16.bf16_master_weights_and_grads: the GPU's share would keep bf16 moments "
                        "whatever bf16_optimizer_states says. Drop one of them")
    block = ds.get("optimizer") if isinstance(ds.get("optimizer"), dict) else {}
    kind = str(block.get("type", "")).lower()
    decoupled = kind == "adamw" or (kind == "adam" and (block.get("params") or {}).get("adam_w_mode", True) is not False)
    if not decoupled and not users_optimizer:
        raise ConfigError("--optimizer.name", f"{block.get('type')} steps the host's share of the optimizer, and {path} "
                          f"(--strategy.deepspeed_config) sets zero_optimization.offload_optimizer.ratio {ratio}, whose "
                          "GPU share DeepSpeed steps with AdamW: pass --optimizer.name adamw, or drop the ratio")
    if not decoupled:
        raise UserError(f"{said}, and DeepSpeed steps the GPU's share with AdamW: the file's optimizer "
                        f"{json.dumps(block.get('type'))} would step the host's share otherwise. Use \"type\": "
                        "\"AdamW\", or drop the ratio")


def _check_pinning_agrees(ds: dict[str, Any], pin: bool | None, path: str) -> None:
    """A user's file decides its offload blocks' ``pin_memory``; an explicit --strategy.offload_pin_memory that
    says otherwise would be dropped without a word, so it is refused instead."""
    if pin is None:
        return
    zero = ds.get("zero_optimization") or {}
    blocks = [name for name in ("offload_optimizer", "offload_param")
              if _offload_device(zero.get(name)) in ("cpu", "nvme")]
    if not blocks:
        raise ConfigError("--strategy.offload_pin_memory", f"has no effect: {path} (--strategy.deepspeed_config) "
                          "offloads nothing; leave --strategy.offload_pin_memory unset")
    for name in blocks:
        value = zero[name].get("pin_memory", False)
        if value != pin:
            said = ("leaves it out (DeepSpeed's default: false)" if "pin_memory" not in zero[name]
                    else f"sets {json.dumps(value)}")
            raise ConfigError("--strategy.offload_pin_memory", f"is {json.dumps(pin)}, but zero_optimization.{name}"
                              f".pin_memory in {path} {said}, and the file decides: set it there, or leave "
                              "--strategy.offload_pin_memory unset")


# --- the DeepSpeed JSON for another trainer ---------------------------------------------------------------------

def portable_ds_config(cfg: RunConfig, world_size: int, precision: ResolvedPrecision, *, for_lightning: bool = False,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON of ``cfg`` for another trainer: the Hugging Face Trainer
    (``TrainingArguments(deepspeed=path)``, with :func:`hf_training_arguments`) or Lightning
    (``DeepSpeedStrategy(config=path)``, with :func:`lightning_trainer_arguments`). Pure.

    It is :func:`make_ds_config` for ``world_size`` GPUs (the configuration zerotrain measured, fast
    path included), changed only where a file run without zerotrain's engine needs it:

    * ``gradient_clipping`` is the configured clip where zerotrain's engine clips itself (the fast
      path writes 0 at ZeRO-0, see :func:`engine_clips`): without that engine, DeepSpeed must clip.
    * Only DeepSpeed's keys are kept (:data:`DS_TOP_LEVEL_KEYS`; ``_comment`` keys are dropped).
    * ``gradient_clipping`` and both precision blocks are always written (DeepSpeed's defaults where
      a user's file left them out): Lightning fills a missing ``gradient_clipping`` from
      ``Trainer(gradient_clip_val)`` and a missing ``fp16``/``bf16`` block from its precision, and
      accelerate (under the HF Trainer) adds precision blocks the same way; with the keys present
      both keep them (``zero_optimization`` too, which accelerate requires). The explicit ``"bf16": {"enabled": false}`` beside ZeRO-0's ``torch_autocast``
      is what keeps Lightning's ``bf16-mixed`` from enabling DeepSpeed's bf16 block on top of it.
    * ZeRO-3 writes ``zero_allow_untested_optimizer`` (DeepSpeed's default, false): Lightning's
      validate/test/predict path indexes it without a default.
    * ``gradient_accumulation_steps``: Lightning refuses the key (whatever its value) and sets it from
      ``Trainer(accumulate_grad_batches)``, while accelerate, under the HF Trainer, writes 1 where the
      key is missing. So one file serves both only at 1: the key is left out there (DeepSpeed and
      accelerate default to 1) and written above 1. ``for_lightning`` leaves it out always: that is
      Lightning's file when accumulating. ``train_batch_size`` stays in both, so DeepSpeed refuses a
      run whose accumulation or GPU count differs from the plan's instead of training another batch.

    ``extra`` is :func:`make_ds_config`'s (facts that fill a user's file's ``"auto"`` values).
    """
    ds = copy.deepcopy(make_ds_config(cfg, world_size, "cuda", precision, extra))
    if engine_clips(cfg, ds):
        ds["gradient_clipping"] = cfg.strategy.gradient_clipping
    ds = {k: _drop_comments(v) for k, v in ds.items() if k in DS_TOP_LEVEL_KEYS}
    ds.setdefault("gradient_clipping", 0.0)
    ds.setdefault("fp16", {"enabled": False})
    ds.setdefault("bf16", {"enabled": False})
    ds.setdefault("zero_optimization", {"stage": 0})  # accelerate refuses a file without the block
    if ds["zero_optimization"].get("stage") == 3:
        ds.setdefault("zero_allow_untested_optimizer", False)
    if for_lightning or ds.get("gradient_accumulation_steps") == 1:
        ds.pop("gradient_accumulation_steps", None)
    return ds


def _drop_comments(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_comments(v) for k, v in node.items() if not str(k).startswith("_")}
    if isinstance(node, list):
        return [_drop_comments(v) for v in node]
    return node


def _accumulation(ds: dict[str, Any], world_size: int) -> int:
    return ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"] * world_size)


def hf_training_arguments(cfg: RunConfig, world_size: int, precision: ResolvedPrecision,
                          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``TrainingArguments`` values that must match :func:`portable_ds_config`'s file.

    The HF Trainer checks these against the file (``HfTrainerDeepSpeedConfig.trainer_config_process``)
    and refuses a mismatch when training starts. ``bf16`` is false where ZeRO-0 runs bf16 as DeepSpeed's
    ``torch_autocast``: the file's ``bf16`` block is off there, and DeepSpeed autocasts by itself. The
    learning-rate schedule is not in the file: the Trainer's own (``lr_scheduler_type``, ``warmup_steps``)
    drives DeepSpeed's optimizer.
    """
    ds = portable_ds_config(cfg, world_size, precision, extra=extra)
    args: dict[str, Any] = {
        "per_device_train_batch_size": ds["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": _accumulation(ds, world_size),
        "bf16": _enabled(ds["bf16"]),
        "fp16": _enabled(ds["fp16"]),
    }
    params = (ds.get("optimizer") or {}).get("params") or {}
    for key, name in (("lr", "learning_rate"), ("weight_decay", "weight_decay"), ("eps", "adam_epsilon")):
        if key in params:
            args[name] = params[key]
    if isinstance(params.get("betas"), list) and len(params["betas"]) == 2:
        args["adam_beta1"], args["adam_beta2"] = params["betas"]
    args["max_grad_norm"] = ds["gradient_clipping"]
    return args


def lightning_trainer_arguments(cfg: RunConfig, world_size: int, precision: ResolvedPrecision,
                                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``lightning.pytorch.Trainer`` values for :func:`portable_ds_config`'s file (``for_lightning=True``).

    ``accumulate_grad_batches`` becomes the file's ``gradient_accumulation_steps`` (DeepSpeed refuses it
    if it disagrees with ``train_batch_size``). ``precision`` matches the file's blocks: ZeRO-0 bf16
    (``torch_autocast``, fp32 weights) is ``32-true``, as zerotrain feeds it fp32 inputs. Clipping is
    the file's ``gradient_clipping``; ``gradient_clip_val`` is not needed (and ``gradient_clip_algorithm``
    must stay ``norm``). With the file's ``optimizer`` block Lightning does not call
    ``configure_optimizers``, so a scheduler returned there is not used: the learning rate stays constant.
    """
    ds = portable_ds_config(cfg, world_size, precision, for_lightning=True, extra=extra)
    mode = "bf16-mixed" if _enabled(ds["bf16"]) else "16-mixed" if _enabled(ds["fp16"]) else "32-true"
    return {"accumulate_grad_batches": _accumulation(ds, world_size), "precision": mode}
