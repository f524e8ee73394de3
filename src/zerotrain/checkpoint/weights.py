"""Model weights as safetensors files: written one shard at a time from lazily produced tensors (host memory holds one\nshard), and read back. Used by every task's export and by zerotrain export."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

DEFAULT_MAX_SHARD_SIZE = "5GB"


LazyTensor = Callable[[], torch.Tensor]


def _const(t: torch.Tensor) -> LazyTensor:
    return lambda: t


def _thunk(v: Any) -> LazyTensor:
    # zero_to_fp32's lazy values are GatheredTensor (ZeRO-3, .contiguous() gathers) or plain tensors.
    return v.contiguous


def materialise(lazy: dict[str, tuple[torch.Size, torch.dtype, LazyTensor]], dtype: Optional[torch.dtype] = None
                ) -> dict[str, torch.Tensor]:
    """The whole state dict in memory (small models, the conversions that need every tensor at once)."""
    return {k: _cast(thunk(), dtype) for k, (_, _, thunk) in lazy.items()}


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    t = t.detach().cpu()
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


class GatheredStateDict(Mapping):
    """A model's whole state dict whose tensors are made only when read, one at a time: the weights of a model
    too big to hold twice, gathered from its partitions on demand (ZeRO-3's and FSDP2's export).

    ``specs`` gives each name's full shape and dtype; ``read(name)`` makes that tensor (on the host). Reading
    a value may be a collective the other ranks serve: see :func:`zerotrain.runtime.collectives.run_on_main`.
    A writer that goes through :func:`lazy_tensors` reads each value once, when its shard is written; anything
    that iterates the values (``dict(weights)``) holds them all, as a state dict would. It is read-only.

    ``serve``: where reads are collectives, what the other ranks call with each name whose read rank 0 makes a
    collective (it asks them: :func:`~zerotrain.runtime.collectives.ask_others`)."""

    def __init__(self, specs: dict[str, tuple[torch.Size, torch.dtype]], read: Callable[[str], torch.Tensor],
                 serve: Optional[Callable[[str], Any]] = None):
        self.specs, self._read, self.serve = specs, read, serve

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's would
        return name in self.specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def renamed(self, rename: Callable[[str], str]) -> "GatheredStateDict":
        """The same tensors under the names ``rename`` gives, still read on demand."""
        old = {rename(k): k for k in self.specs}
        return GatheredStateDict({new: self.specs[k] for new, k in old.items()}, lambda name: self._read(old[name]),
                                 self.serve)

    def without(self, names: set[str]) -> "GatheredStateDict":
        """The same tensors less ``names``."""
        return GatheredStateDict({k: v for k, v in self.specs.items() if k not in names}, self._read, self.serve)


def lazy_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype, LazyTensor]]:
    """A state dict in the shape :func:`write_safetensors` reads: one in hand (on any device), or a
    :class:`GatheredStateDict`, each of whose tensors is then read when its shard is written."""
    if isinstance(state_dict, GatheredStateDict):
        return {k: (shape, dtype, (lambda k=k: state_dict[k])) for k, (shape, dtype) in state_dict.specs.items()}
    return {k: (v.shape, v.dtype, _const(v)) for k, v in state_dict.items()}


def write_safetensors(lazy: dict[str, tuple[torch.Size, torch.dtype, LazyTensor]], out_dir: Path,
                      dtype: Optional[torch.dtype], max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                      rename: Optional[Callable[[str], str]] = None,
                      progress: Optional[Callable[[str], None]] = None) -> list[str]:
    """Write ``model.safetensors`` (or shards and ``model.safetensors.index.json``); return the file names.

    Shards are planned from shapes alone (Hugging Face's splitter on empty tensors) and each is
    materialised on the host, written and dropped before the next, so memory holds one shard at a time.
    ``dtype`` None keeps each tensor's own; ``progress`` gets a line per shard written.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    rename = rename or (lambda k: k)
    names = {rename(k): k for k in lazy}
    meta = {new: torch.empty(lazy[old][0], dtype=(dtype or lazy[old][1]) if lazy[old][1].is_floating_point
                             else lazy[old][1], device="meta") for new, old in names.items()}
    max_shard_size = _shard_size_for_host(max_shard_size, progress, sum(t.nbytes for t in meta.values()))
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, done, total = [], 0, sum(t.nbytes for t in meta.values())
    for filename, tensors in split.filename_to_tensors.items():
        shard, storages = {}, set()
        for n in tensors:
            t = _cast(lazy[names[n]][2](), dtype).contiguous()
            if t.untyped_storage().data_ptr() in storages:
                t = t.clone()  # tied weights share storage, which safetensors refuses to write twice
            storages.add(t.untyped_storage().data_ptr())
            shard[n] = t
        save_file(shard, str(out_dir / filename), metadata={"format": "pt"})
        written.append(filename)
        done += sum(t.nbytes for t in shard.values())
        del shard
        if progress:
            progress(f"wrote {out_dir / filename} ({_size(done)} of {_size(total)})")
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append("model.safetensors.index.json")
    return written


MIN_SHARD_BYTES = 2**26


UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int | float) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``5e9``, ``100B`` or a number of bytes (Hugging Face's ``max_shard_size``
    spellings). Raises ValueError for anything else."""
    if isinstance(size, (int, float)):
        return int(size)
    text = str(size).strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * UNITS[unit])
    return int(float(text.removesuffix("B")))


def _shard_size_for_host(max_shard_size: str | int, progress: Optional[Callable[[str], None]],
                         total_bytes: Optional[int] = None) -> int:
    """``max_shard_size``, or less when this host has little memory free. A shard may be on the host twice while
    it is written (the tensors copied from the GPU, and, in older safetensors releases, their serialised bytes;
    0.8 writes from the tensors: a 4.94 GB shard added 4.61 GiB), so shards are kept to a quarter of the free
    memory: the end of a big run whose optimizer fills the host (5B parameters under CPU offload: 120 of 125 GiB)
    still exports, in more files. ``progress`` is told only when that changes the files
    written: a model of ``total_bytes`` that fits in one smaller shard is written as one file either way."""
    import psutil

    wanted = parse_size(max_shard_size)
    free = psutil.virtual_memory().available
    if 4 * wanted <= free:
        return wanted
    smaller = max(MIN_SHARD_BYTES, free // 4)
    if progress and (total_bytes is None or total_bytes > smaller):
        progress(f"{_size(free)} of host memory free: shards of {_size(smaller)} instead of {_size(wanted)}")
    return smaller


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """``folder``'s ``model.safetensors``, or every shard its ``model.safetensors.index.json`` names, as one
    state dict. Raises ``FileNotFoundError`` when neither file is there."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(2, "no such file", str(folder / "model.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(2, "no such file", str(folder / name))
        state.update(load_file(str(folder / name)))
    return state
