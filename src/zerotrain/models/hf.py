"""Hugging Face models for the recipes: one place that loads, wraps, sizes and writes them.

Every recipe built on a ``transformers`` Auto class (``lora``, ``causal-lm``, ``classify``, ``mlm`` with
``--model.name_or_path``) loads its model here, so that a local folder, a hub name and a random model made
from a ``config.json`` behave the same everywhere, with the same one-line errors:

* a local folder saved with ``save_pretrained`` is read as it is;
* a hub name is read from the network or the local Hugging Face cache; with no network, the hub is not
  retried for minutes: the load fails at once, saying to pass a local folder or ``--model.init random``;
* ``init="random"`` builds the architecture a ``config.json`` describes, untrained (tests, smoke runs,
  pre-training from scratch).

The weights' dtype follows ``--model.dtype`` (``auto``: the run's ``--precision.dtype`` when that is bf16 or
fp16, else fp32).

Under DeepSpeed ZeRO-3 the training loop builds the model inside
:func:`zerotrain.engines.build.model_construction`: the model is then built partitioned (transformers'
``zero.Init`` path, each module's parameters split over the ranks as soon as it exists, initialised one module at a
time) and a pretrained model's weights are read one tensor at a time into the partitions
(:func:`load_partitioned`). No process holds the whole model, in host or device memory: at most one weights
file mapped, one full tensor, and its own partition. transformers' own ``from_pretrained`` under ZeRO-3 reads
every file into one state dict on rank 0 first, the whole model in host memory.

A random model built partitioned is initialised module by module, which draws the random numbers in another
order than the whole model's initialisation: the same seed gives other weights than a build outside ZeRO-3.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn

from zerotrain.checkpoint.weights import DEFAULT_MAX_SHARD_SIZE, GatheredStateDict, lazy_tensors, write_safetensors
from zerotrain.data.io import hub_offline, looks_local
from zerotrain.engines.partitioning import zero3_config
from zerotrain.engines.states import full_numel
from zerotrain.errors import ConfigError, UserError
from zerotrain.runtime.collectives import all_reduce_max, broadcast_object

logger = logging.getLogger(__name__)


@dataclass
class ModelSection:
    """``--model``: which Hugging Face model a recipe trains, pretrained or built untrained from a config."""

    name_or_path: str = ""
    """The model: a local folder saved with save_pretrained, or a hub name (needs network or the HF cache)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained loads the weights of name_or_path; random builds an untrained model from --model.config."""
    config: Optional[str] = None
    """init=random: a config.json file (or a folder holding one) describing the architecture."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    """Weights' dtype when loading; auto follows --precision.dtype (bf16/fp16 there, else fp32). Training keeps
    fp32 master weights, so fp32 is the default."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub name; default --model.name_or_path."""
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "flash_attention_2", "eager"] = "auto"
    """The attention kernels (transformers' attn_implementation); auto is transformers' choice (sdpa where the
    model supports it). flex_attention keeps packed documents apart without a dense mask; flash_attention_2 needs
    the flash-attn package."""

    def source(self) -> "ModelSource":
        """Where the model comes from, as these flags say."""
        return ModelSource(self.name_or_path, self.init, self.config,
                           attn_implementation=None if self.attn_implementation == "auto" else self.attn_implementation)

    def validate(self) -> None:
        if self.init == "pretrained" and not self.name_or_path:
            raise ConfigError("--model.name_or_path", "is required: a model folder or hub name "
                                                      "(or --model.init random --model.config FILE)")
        if self.init == "random":
            if not self.config:
                raise ConfigError("--model.config", "is required with --model.init random (a config.json file or "
                                                    "a folder holding one)")
            if not Path(self.config).expanduser().exists():
                raise ConfigError("--model.config", f"file {self.config!r} does not exist")
            if not (self.tokenizer or self.name_or_path):
                raise ConfigError("--model.tokenizer", "is required with --model.init random")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Kind = Literal["causal-lm", "classify", "masked-lm"]
_AUTO_CLASS = {"causal-lm": "AutoModelForCausalLM", "classify": "AutoModelForSequenceClassification",
               "masked-lm": "AutoModelForMaskedLM"}
_WHAT = {"causal-lm": "a causal LM", "classify": "a sequence classifier", "masked-lm": "a masked LM"}


def auto_class(kind: Kind):
    """The ``transformers`` Auto class that builds a model of ``kind``."""
    import transformers

    return getattr(transformers, _AUTO_CLASS[kind])


def resolve_dtype(choice: str, precision_dtype: str) -> torch.dtype:
    """``--model.dtype``; ``auto`` follows ``--precision.dtype`` (bf16/fp16 there, else fp32)."""
    if choice == "auto":
        choice = precision_dtype if precision_dtype in ("bf16", "fp16") else "fp32"
    return DTYPES[choice]


@dataclass
class ModelSource:
    """Where a Hugging Face model comes from, as the recipes' ``--model.*`` flags say."""

    name_or_path: str
    """A local folder saved with save_pretrained, or a hub name."""
    init: str = "pretrained"
    """pretrained: the weights of name_or_path; random: an untrained model from ``config``."""
    config: Optional[str] = None
    """init=random: a config.json (or a folder holding one)."""
    flag: str = "--model"
    """The flags' prefix, for error messages (``--model``: ``--model.name_or_path``, ``--model.config``)."""
    attn_implementation: Optional[str] = None
    """transformers' ``attn_implementation`` (None: its own choice)."""


def read_config(source: ModelSource, overrides: Optional[dict[str, Any]] = None):
    """The ``transformers`` config of ``source``: its ``config.json`` (random init) or the model folder's / hub
    repository's. ``overrides`` are set on it (``num_labels``, ``id2label``)."""
    from transformers import AutoConfig

    f = source.flag
    if source.init == "random":
        if not source.config:
            raise ConfigError(f"{f}.config", "is required with --model.init random (a config.json file or a folder "
                                             "holding one)")
        try:
            config = AutoConfig.from_pretrained(str(Path(source.config).expanduser()))
        except (OSError, ValueError) as exc:
            raise UserError(f"{f}.config: cannot read a model config from {source.config!r} "
                            f"({type(exc).__name__}: {_first_line(exc)})") from None
    else:
        where = _checked_source(source)
        try:
            config = AutoConfig.from_pretrained(where)
        except (OSError, ValueError) as exc:
            raise _load_error(source, "a model config", exc) from None
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def builds_partitioned(source: ModelSource, redrawn: bool = False) -> bool:
    """Whether :func:`load_model` (``pretrained``) builds the model partitioned over the ranks inside a ZeRO-3
    construction block, so that no process ever holds it whole: pretrained weights always, a random init
    unless ``redrawn`` (its weights drawn again after the build, which needs them whole)."""
    return source.init != "random" or not redrawn


def load_model(kind: Kind, source: ModelSource, dtype: torch.dtype, pretrained: bool = True,
               min_vocab: Optional[int] = None, config_overrides: Optional[dict[str, Any]] = None,
               redrawn: bool = False) -> nn.Module:
    """The model of ``kind`` from ``source``, on CPU, in ``dtype``.

    ``pretrained=False`` builds the architecture without reading any weights (``zerotrain estimate``, and what
    a finished run's weights load into). ``min_vocab`` (the tokenizer's size) is checked against a random
    model's ``vocab_size``: a smaller embedding than the tokenizer would index past its end.
    ``config_overrides`` (``num_labels``, ``id2label``, ``label2id``) are set on the config before the model is
    built, so a pretrained encoder gets a fresh classification head of the right size.

    Inside the training loop's model construction under ZeRO-3 the model is built partitioned (see the module's
    docstring). A random model is laid out on the meta device and initialised once (:func:`_built_then_initialised`);
    ``redrawn=True`` is for weights that are never saved and are drawn again from the seed outside the run (a
    random LoRA base): they are built whole, by ``from_config`` directly, whose draw order does not change with
    ZeRO-3 or with this module.
    """
    cls = auto_class(kind)
    overrides = dict(config_overrides or {})
    attention = {"attn_implementation": source.attn_implementation} if source.attn_implementation else {}
    try:
        return _load(cls, kind, source, dtype, pretrained, min_vocab, overrides, attention, redrawn)
    except ImportError as exc:  # an attention kernel whose package is not installed (flash-attn)
        raise UserError(f"{source.flag}.attn_implementation {source.attn_implementation}: {_first_line(exc).rstrip('.')}; "
                        f"install it or pick another (sdpa, flex_attention, eager)") from None


def _load(cls, kind: Kind, source: ModelSource, dtype: torch.dtype, pretrained: bool, min_vocab: Optional[int],
          overrides: dict[str, Any], attention: dict[str, str], redrawn: bool) -> nn.Module:
    ds = zero3_config()
    if ds is not None and pretrained and source.init != "random":
        return _load_partitioned_pretrained(kind, cls, source, dtype, overrides, ds, attention)
    partition = ds is not None and pretrained and builds_partitioned(source, redrawn)
    if source.init == "random" or not pretrained:
        config = read_config(source, overrides)
        vocab = getattr(config, "vocab_size", None)
        if source.init == "random" and min_vocab is not None and isinstance(vocab, int) and vocab < min_vocab:
            raise ConfigError(f"{source.flag}.config",
                              f"vocab_size {vocab} is smaller than the tokenizer's {min_vocab} tokens; raise "
                              f"vocab_size in the config file or use a matching {source.flag}.tokenizer")
        try:
            if partition or redrawn or not _init_weights_sets_buffers():
                with built_partitioned(ds if partition else None):
                    return cls.from_config(config, dtype=dtype, **attention)
            return _built_then_initialised(cls, config, dtype, attention)
        except ValueError as exc:
            raise UserError(f"{source.flag}.config: {source.config or source.name_or_path!r} does not describe "
                            f"{_WHAT[kind]} ({_first_line(exc)})") from None
    where = _checked_source(source)
    try:
        with _quiet_load_report():
            return cls.from_pretrained(where, dtype=dtype, **attention, **overrides)
    except (OSError, ValueError) as exc:
        raise _load_error(source, _WHAT[kind], exc) from None


def _init_weights_sets_buffers() -> bool:
    """Whether this transformers' ``init_weights`` is known to set a model's computed buffers too (rotary
    frequencies and the like): checked from 5.24 on (tests/models/test_random_init.py). Without that, a model given
    memory after the meta device would keep them unset, so older versions build with ``from_config``."""
    from importlib.metadata import version

    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version("transformers").split(".")[:2])
    return (major, minor) >= (5, 24)


def _built_then_initialised(cls: Any, config: Any, dtype: torch.dtype, attention: dict[str, str]) -> nn.Module:
    """A random model laid out on the meta device, given memory on the default device, then initialised once by
    transformers' ``init_weights`` (weights, computed buffers, tied weights).

    ``from_config`` on a real device runs every layer's own PyTorch initialisation and then transformers'
    ``_init_weights`` over it, so the first is thrown away: on a CPU about a third of the build (Llama-shaped 1.1B,
    2 cores: 13-15 s built directly, 9 s this way). The weights follow the same distributions, drawn in another
    order. Where the default device is the meta device (``zerotrain estimate`` sizes models there), nothing is
    allocated or initialised."""
    device = torch.get_default_device()
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype, **attention)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


@contextlib.contextmanager
def built_partitioned(ds: Optional[dict[str, Any]]):
    """transformers builds models partitioned as the ZeRO-3 JSON ``ds`` says in this block (None: whole).

    transformers' own switch for it is a live ``HfDeepSpeedConfig`` (a public, weakly referenced global): while it
    lives, ``from_config`` builds inside DeepSpeed's ``zero.Init`` (each module's parameters split over the ranks as
    soon as the module exists) and initialises the model one module at a time, gathered. It lives for this block
    only, so that models built later in the process (an export's copy on rank 0 alone) are whole again.
    """
    if ds is None:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    switch = HfDeepSpeedConfig(ds)
    try:
        yield
    finally:
        del switch  # the weak reference dies with it: transformers builds whole models again


def _load_partitioned_pretrained(kind: Kind, cls: Any, source: ModelSource, dtype: torch.dtype,
                                 overrides: dict[str, Any], ds: dict[str, Any], attention: dict[str, str]) -> nn.Module:
    """A pretrained model built partitioned and filled one tensor at a time (see :func:`load_partitioned`).

    The architecture comes from the folder's config (``overrides`` set on it, as ``from_pretrained`` sets them)
    and is built by ``from_config`` in ZeRO-3's ``zero.Init``, with transformers' initialisation, so that tensors
    the weights files lack (a classifier's new head) start as ``from_pretrained`` would start them.
    """
    where = _checked_source(source)
    config = read_config(source, overrides)
    files = weight_files(where, source)
    try:
        with built_partitioned(ds):
            model = cls.from_config(config, dtype=dtype, **attention)
    except ValueError as exc:
        raise _load_error(source, _WHAT[kind], exc) from None
    load_partitioned(model, files, source.flag)
    return model


_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def weight_files(where: str, source: Optional[ModelSource] = None) -> list[Path]:
    """The weights files of the model folder (or hub name) ``where``, in the order its index lists them:
    safetensors shards when there are any, else PyTorch ``.bin`` files."""
    folder = Path(where)
    if not folder.is_dir():
        folder = _hub_snapshot(where, source or ModelSource(where))
    for index, single in zip(_WEIGHT_INDEXES, _WEIGHT_FILES):
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text(encoding="utf-8")).get("weight_map", {})
            names = list(dict.fromkeys(weight_map.values()))
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise UserError(f"{(source or ModelSource(where)).flag}.name_or_path: {folder / index} lists "
                                f"{missing[0]}, which is missing: copy the whole model folder")
            return [folder / n for n in names]
        if (folder / single).is_file():
            return [folder / single]
    raise UserError(f"{(source or ModelSource(where)).flag}.name_or_path: no weights file in {folder} "
                    f"(looked for {', '.join(_WEIGHT_INDEXES + _WEIGHT_FILES)}): pass a folder written by "
                    "save_pretrained")


def _hub_snapshot(name: str, source: ModelSource) -> Path:
    """The local copy of hub model ``name``'s config and weights (the Hugging Face cache, or downloaded)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # huggingface_hub's errors have no common base beyond OSError/ValueError/HTTP ones
        raise _load_error(source, "model weights", exc) from None


class _WeightsFile:
    """One weights file, read a tensor at a time: safetensors memory-mapped (closing it unmaps it), a ``.bin``
    through ``torch.load(mmap=True, weights_only=True)``. Shapes come from the header alone."""

    def __init__(self, path: Path, flag: str = "--model"):
        self.path, self.flag = path, flag
        self._safe = path.name.endswith(".safetensors")
        self._handle: Any = None

    def __enter__(self) -> "_WeightsFile":
        if self._safe:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        else:
            try:
                self._handle = torch.load(str(self.path), map_location="cpu", mmap=True, weights_only=True)
            except (RuntimeError, OSError, ValueError) as exc:  # mmap needs the zip format torch has saved since 1.6
                raise UserError(f"{self.flag}.name_or_path: {self.path} cannot be read a tensor at a time "
                                f"({_first_line(exc)}): save the model again with save_pretrained (safetensors)") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle = None  # drops the mapping: the pages read so far leave this process's memory

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        if self._safe:
            return tuple(self._handle.get_slice(key).get_shape())
        return tuple(self._handle[key].shape)

    def tensor(self, key: str) -> torch.Tensor:
        return self._handle.get_tensor(key) if self._safe else self._handle[key]


def load_partitioned(model: nn.Module, files: list[Path], flag: str = "--model") -> None:
    """Copy the tensors of ``files`` (a model's weights files) into ``model``, whose parameters ZeRO-3
    partitioned as it was built (``zero.Init``): one file open at a time, one parameter gathered at a time.

    Every rank walks the files' headers in the same order and gathers each parameter the files hold
    (``GatheredParameters``, a collective); rank 0 alone reads the tensor's values and copies them in, and
    leaving the gather hands each rank its part. Buffers are not partitioned: every rank reads its own (they are
    small). A key is matched to the model's names as they are, or with the model's ``base_model_prefix`` added or
    removed (a base model's weights into a model with a head, and back). Parameters the files lack keep the
    initialisation they were built with, and the log names them; a tensor whose shape differs from the model's,
    or files of which no tensor fits, are one-line errors.
    """
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "") or ""
    loaded: set[int] = set()
    unexpected: list[str] = []
    for path in files:
        with _WeightsFile(path, flag) as weights, torch.no_grad():
            for key in weights.keys():
                name = _model_name(key, params, buffers, prefix)
                if name is None:
                    unexpected.append(key)
                    continue
                target = params.get(name, buffers.get(name))
                want = tuple(target.ds_shape if hasattr(target, "ds_shape") else target.shape)
                got = weights.shape(key)
                if got != want:
                    raise UserError(f"{flag}.name_or_path: {path.name} holds {key} of shape {list(got)}, but the "
                                    f"model built from its config.json has {list(want)}: the folder's config and "
                                    "weights do not belong together")
                if name in buffers:
                    target.copy_(weights.tensor(key))
                    continue
                # Rank 0 reads the values before the gather, and the ranks agree that it could: a rank that
                # failed inside the gather would leave the others waiting in it.
                value = _read_on_rank0(weights, key, rank, flag)
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    if rank == 0:
                        target.data.copy_(value)
                value = None
                loaded.add(id(target))
    missing = sorted({n for n, p in params.items() if id(p) not in loaded})
    if not loaded:
        example = f"e.g. {unexpected[0]!r}" if unexpected else "they hold no tensors"
        raise UserError(f"{flag}.name_or_path: no tensor of {files[0].parent} fits the model built from its "
                        f"config.json ({example}): pass a folder written by save_pretrained for this kind of model")
    logger.info("weights read into the ZeRO-3 partitions one tensor at a time from %d file(s)%s", len(files),
                f"; {len(missing)} tensor(s) not in them keep their fresh initialisation: "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "")
    if unexpected:
        logger.info("%d tensor(s) of the weights files are not in the model and were skipped: %s", len(unexpected),
                    ", ".join(unexpected[:4]) + (" ..." if len(unexpected) > 4 else ""))


def _read_on_rank0(weights: "_WeightsFile", key: str, rank: int, flag: str) -> Optional[torch.Tensor]:
    """Rank 0's copy of tensor ``key`` (None on the other ranks), once every rank knows that rank 0 read it.

    If rank 0 could not, every rank raises the same one-line :class:`UserError` naming the file, with rank 0's
    reason (an all-reduce of a flag, then the reason broadcast only on failure)."""
    import torch.distributed as dist

    value, reason = None, None
    if rank == 0:
        try:
            value = weights.tensor(key)
        except Exception as exc:  # safetensors' and torch's read errors share no base class
            reason = f"{type(exc).__name__}: {_first_line(exc)}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if all_reduce_max(float(reason is not None), device) > 0:
            reason = broadcast_object(reason)
    if reason is not None:
        raise UserError(f"{flag}.name_or_path: {weights.path}: tensor {key} could not be read ({reason}): the "
                        "file is damaged or was written by a newer library; copy or save the model folder again")
    return value


def _model_name(key: str, params: dict, buffers: dict, prefix: str) -> Optional[str]:
    """The model's name for checkpoint ``key``: itself, or with the base model's prefix added or removed."""
    candidates = [key]
    if prefix:
        candidates.append(f"{prefix}.{key}")
        if key.startswith(prefix + "."):
            candidates.append(key[len(prefix) + 1:])
    return next((c for c in candidates if c in params or c in buffers), None)


def _checked_source(source: ModelSource) -> str:
    local = looks_local(source.name_or_path)
    if not source.name_or_path:
        raise ConfigError(f"{source.flag}.name_or_path", "is required with --model.init pretrained")
    if local and not Path(source.name_or_path).expanduser().is_dir():
        raise UserError(f"{source.flag}.name_or_path: model folder {source.name_or_path!r} does not exist")
    if not local:
        hub_offline()  # offline, fail at once with the message below instead of minutes of retries
    return str(Path(source.name_or_path).expanduser()) if local else source.name_or_path


def _load_error(source: ModelSource, what: str, exc: BaseException) -> UserError:
    where = (f"folder {source.name_or_path!r}" if looks_local(source.name_or_path)
             else f"hub name {source.name_or_path!r}")
    return UserError(f"{source.flag}.name_or_path: could not load {what} from the {where} "
                     f"({type(exc).__name__}: {_first_line(exc)}). Offline, pass a local folder saved with "
                     f"save_pretrained via {source.flag}.name_or_path, or use --model.init random "
                     f"{source.flag}.config FILE")


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0]


@contextlib.contextmanager
def _quiet_load_report():
    """transformers prints a table of the weights a checkpoint lacks (a classifier's new head) at warning level
    on every load; the recipes state what they initialise themselves. Errors still raise."""
    from transformers.utils import logging as hf_logging

    before, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" per load, printed over predict's output
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        if bars:
            hf_logging.enable_progress_bar()


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Hugging Face's own activation checkpointing (non-reentrant), and no KV cache: training reads none, and
    transformers turns it off under checkpointing anyway, with a warning."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


# ---- LoRA ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def peft_quiet():
    """peft (0.21) reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model, and
    transformers 5 warns (FutureWarning) on every read. The call is peft's, not the user's: ignore that one
    warning while peft wraps, and nothing else."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


@dataclass
class LoRASettings:
    """Low-rank adapters on a frozen base (peft)."""

    r: int = 8
    alpha: int = 32
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    flag: str = "--model.lora"
    """How the recipe spells these flags' prefix, for errors (``--model.lora``: ``--model.lora.r``)."""

    def flag_of(self, name: str) -> str:
        return f"{self.flag}.{name}" if self.flag.endswith(".lora") else f"{self.flag}{name}"


def add_lora(base: nn.Module, lora: LoRASettings, task_type: str, checkpointing: bool) -> nn.Module:
    """``base`` wrapped by peft with adapters on ``lora.target_modules``; only the adapters train.

    With activation checkpointing, the embedding's output is marked as requiring grad: the embedding is frozen,
    so otherwise a reentrant checkpointed segment would see no grad-requiring input and the adapters inside it
    would silently get no gradient. Marking it costs one small extra grad and is safe whichever variant of
    checkpointing a model uses.
    """
    from peft import LoraConfig, get_peft_model

    if checkpointing:
        enable_activation_checkpointing(base)
        base.enable_input_require_grads()
    config = LoraConfig(task_type=task_type, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules))
    try:
        with peft_quiet():
            return get_peft_model(base, config)
    except ValueError as exc:
        raise ConfigError(lora.flag_of("target_modules"), f"{list(lora.target_modules)}: {_first_line(exc)}") from None


def trainable_summary(model: nn.Module) -> str:
    """peft's line: trainable and total parameters."""
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(full_numel(p) for p in model.parameters())
    return (f"trainable params: {trainable:,} || all params: {total:,} || "
            f"trainable%: {100 * trainable / max(total, 1):.4f}")


def lora_adapter_state(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of the consolidated ``state_dict`` of a peft model; refuses empty ones.

    Under ZeRO-3 the live parameters are empty partitions, and peft would happily write an adapter of empty
    tensors: the adapter must come from the consolidated state dict the loop passes to ``Task.export``.
    """
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)
    empty = [k for k, v in adapter.items() if v.numel() == 0]
    if not adapter or empty:
        raise RuntimeError(
            "refusing to write an empty LoRA adapter "
            f"({'no adapter tensors in the state dict' if not adapter else f'{len(empty)} empty tensors, e.g. {empty[0]}'}). "
            "Under ZeRO-3 parameters are partitioned: export from the consolidated state dict "
            "(stage3_gather_16bit_weights_on_model_save / zero_to_fp32), not the live module")
    return adapter


def write_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], folder: Path, tokenizer: Any) -> None:
    """The peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and the tokenizer in ``folder``."""
    lora_adapter_state(model, state_dict)
    folder.mkdir(parents=True, exist_ok=True)
    with peft_quiet():
        model.save_pretrained(str(folder), state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
    tokenizer.save_pretrained(str(folder))


def merged_copy(rebuild: Callable[[], nn.Module], state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU model with the adapters of ``state_dict`` folded into the base weights.

    ``rebuild`` makes the peft model afresh (on CPU): the live one may sit on a GPU or be ZeRO-3 partitioned,
    and merging it in place would change the module the engine still holds.
    """
    fresh = rebuild()
    fresh.load_state_dict({k: v.detach().cpu() for k, v in state_dict.items()}, strict=True)
    merged = fresh.merge_and_unload()
    if getattr(merged, "config", None) is not None:
        merged.config.use_cache = True  # turned off for checkpointed training; generation wants it
    return merged


# ---- a Hugging Face folder -------------------------------------------------------------------------
def strip_module_prefix(state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if state_dict and all(k.startswith("module.") for k in state_dict):
        if isinstance(state_dict, GatheredStateDict):  # still read a tensor at a time
            return state_dict.renamed(lambda k: k[len("module."):])
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return state_dict


def save_hf_folder(model: nn.Module, state_dict: Optional[Mapping[str, torch.Tensor]], out_dir: Path, tokenizer: Any,
                   generation: bool = False) -> None:
    """``out_dir`` as ``save_pretrained`` writes it (config, safetensors weights, tokenizer, and with
    ``generation`` a ``generation_config.json`` whose eos/pad/bos are the tokenizer's), which ``AutoModelFor*``
    ``.from_pretrained`` loads.

    ``state_dict`` (the consolidated weights; None: the model's own) is written through ``model``'s
    ``save_pretrained``, which drops tied copies (GPT-2's ``lm_head`` is its embedding) as transformers does.
    A :class:`GatheredStateDict` (a ZeRO-3 or FSDP2 model's) is written a shard at a time instead, so the host never
    holds the whole model: the tensors, names and config ``save_pretrained`` writes, in zerotrain's shards (5 GB)
    and without transformers' extras (custom-code files, the index's parameter count); where the model saves its
    weights under other names than it holds them (transformers' conversion mappings), it is gathered whole and
    saved as above.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = True  # off for checkpointed training; generation wants it
    state_dict = strip_module_prefix(state_dict) if state_dict is not None else None
    if not (isinstance(state_dict, GatheredStateDict) and _save_weights_streamed(model, state_dict, out_dir)):
        kwargs = {"state_dict": dict(state_dict)} if state_dict is not None else {}
        model.save_pretrained(str(out_dir), safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(str(out_dir))
    if generation:
        from transformers import GenerationConfig

        gen = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
        gen.save_pretrained(str(out_dir))


def _save_weights_streamed(model: nn.Module, weights: GatheredStateDict, out_dir: Path) -> bool:
    """``save_pretrained``'s config and weights for ``model`` from ``weights``, read a shard at a time: the keys
    it would write, its ``dtype`` and ``architectures`` in the config. False, writing nothing, where
    :func:`_saved_keys` cannot say which keys those are."""
    kept = _saved_keys(model, weights.specs)
    if kept is None:
        logger.info("export: which tensors save_pretrained writes for %s cannot be told without them (a conversion "
                    "on save, or a transformers before 5): gathered whole on the host to write them",
                    type(model).__name__)
        return False
    model.config.dtype = str(getattr(model, "dtype", torch.float32)).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 renames the class it shards
    model.config.save_pretrained(str(out_dir))
    write_safetensors(lazy_tensors(weights.without(set(weights.specs) - kept)), out_dir, dtype=None,
                      max_shard_size=DEFAULT_MAX_SHARD_SIZE, progress=lambda line: logger.info("export: %s", line))
    return True


def _saved_keys(model: nn.Module, specs: Mapping[str, tuple[torch.Size, torch.dtype]]) -> Optional[set[str]]:
    """The state-dict keys ``save_pretrained`` writes for ``model`` (``specs``: name -> shape and dtype of its
    full state dict): less what the model ignores on save and the tied copies, found as transformers finds them,
    here on the meta device. None where the model renames or converts its weights on save (transformers'
    conversion mappings: Mixtral's and other mixtures of experts' fused experts), which needs them all at once,
    or where this transformers cannot tell (4.x has neither function)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in specs.items()}
        for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
            meta.pop(key, None)
        meta = remove_tied_weights_from_state_dict(meta, model)
        reverted = revert_weight_conversion(model, dict(meta))
        if {k: tuple(t.shape) for k, t in reverted.items()} != {k: tuple(t.shape) for k, t in meta.items()}:
            return None  # renamed, split, fused or padded on save
        return set(meta)
    except Exception:  # noqa: BLE001 - an older transformers, or a conversion meta tensors cannot go through
        return None


def exports_streamed(model: nn.Module) -> bool:
    """Whether a ZeRO-3 or FSDP2 run of ``model`` (as its recipe builds it) exports a shard at a time, for the memory
    model: True for models written with :func:`~zerotrain.checkpoint.weights.write_safetensors` or
    :func:`save_hf_folder`'s streamed path; False for a peft model (the adapter and merged model need every
    weight) and a Hugging Face model whose saved keys :func:`_saved_keys` cannot give."""
    if getattr(model, "peft_config", None) is not None:
        return False
    if getattr(model, "config", None) is None or not hasattr(model, "save_pretrained"):
        return True
    specs = {k: (t.shape, t.dtype) for k, t in model.state_dict().items()}
    return _saved_keys(model, specs) is not None


def is_hf_folder(folder: Path) -> bool:
    """Whether ``folder`` is a ``save_pretrained`` folder (its config.json names a ``model_type``)."""
    try:
        return "model_type" in json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def load_hf_folder_into(kind: Kind, model: nn.Module, folder: Path) -> None:
    """Load the weights of the ``save_pretrained`` folder ``folder`` into ``model`` (built from the same config):
    through ``from_pretrained``, which restores tied weights, then the whole state dict strictly."""
    cls = auto_class(kind)
    try:
        with _quiet_load_report():
            loaded = cls.from_pretrained(str(folder), dtype=next(model.parameters()).dtype)
        model.load_state_dict(loaded.state_dict())
    except (OSError, ValueError, RuntimeError) as exc:
        detail = " ".join(str(exc).split())
        raise UserError(f"{folder} does not fit the model the run's hparams.json describes "
                        f"({type(exc).__name__}: {detail[:300]})") from None


# ---- FLOPs -----------------------------------------------------------------------------------------
def transformer_flops_per_token(model: nn.Module, seq_len: int, trainable_only: bool = False) -> float:
    """Training FLOPs per token: 6 x parameters (4 x for frozen ones) + 12 x layers x width x ``seq_len``.

    The first term is the matmuls of every weight (2 forward + 4 backward; a frozen weight skips its own
    gradient, 2 of the 4). The second is attention's score and value matmuls, which grow with the context
    (PaLM's appendix B formula, counted over the full ``seq_len`` as it does). The embedding lookup is no matmul,
    so the input embedding is left out unless it is tied to the output head. Layers and width come from the
    model's config (``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``/``dim``); a config without them
    gets the parameter term only.
    """
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", lambda: model)()
    embedding = None
    get_in = getattr(base, "get_input_embeddings", None)
    get_out = getattr(base, "get_output_embeddings", None)
    if get_in is not None:
        embedding = get_in()
    tied = get_out is not None and embedding is not None and get_out() is not None and \
        get_out().weight is embedding.weight
    skip = set() if embedding is None or tied else {id(p) for p in embedding.parameters()}
    flops = 0.0
    for p in model.parameters():
        if id(p) in skip:
            continue
        flops += (6.0 if p.requires_grad else 4.0) * full_numel(p)
    layers = _first_attr(config, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"))
    width = _first_attr(config, ("hidden_size", "n_embd", "dim", "d_model"))
    if layers and width:
        flops += 12.0 * layers * width * seq_len
    return flops


def _first_attr(config: Any, names: tuple[str, ...]) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_implementation(model: nn.Module) -> str:
    """The attention kernel transformers picked for ``model`` (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def export_checkpoint(task: Any, lazy: dict, out_dir: Path, dtype: torch.dtype) -> list[str]:
    """``zerotrain export --format hf`` for a recipe whose :meth:`Task.export` writes a Hugging Face folder: the
    checkpoint's tensors (``lazy``, name -> (shape, dtype, thunk)) go into the model the run's hparams describe
    (built without reading pretrained weights), floating-point ones cast to ``dtype``, and the task's own export
    writes ``out_dir``. Returns the files written, relative to ``out_dir``."""
    with torch.random.fork_rng(devices=[]):
        model = task.build_model(pretrained=False)
    state = strip_module_prefix({name: thunk() for name, (_, _, thunk) in lazy.items()})
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise UserError(f"the checkpoint does not fit the model hparams.json describes "
                        f"({' '.join(str(exc).split())[:300]})") from None
    if dtype != torch.float32:
        model = model.to(dtype)
    task.export(model, model.state_dict(), Path(out_dir))
    return sorted(str(p.relative_to(out_dir)) for p in Path(out_dir).rglob("*") if p.is_file())
