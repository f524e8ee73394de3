"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), read without running code.

The FSDP2 engine writes its model and optimizer state as one DCP checkpoint in ``<step>/dcp/``: a
``__<rank>_0.distcp`` file per writing rank and a ``.metadata`` file that says which slice of which
tensor each holds. DCP reads it back on any process count, each rank taking the slices of its shards
(resharding), and without any process group (:func:`model_tensors`, for ``zerotrain export``).

Decision: DCP's own reader runs code a crafted file asks for. torch 2.13's ``FileSystemReader``
unpickles ``.metadata`` with plain ``pickle.load``, and its default load planner reads every
non-tensor value (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``; only
the tensors are read weights-only. The marker's checksums find damage, not a replaced file whose
marker was rewritten with it, so the other loaders' rule is kept instead: :class:`SafeReader`
unpickles ``.metadata`` admitting only DCP's record classes (:data:`METADATA_GLOBALS`), torch's
dtypes and ``torch.Size``, and :class:`SafePlanner` reads every non-tensor value weights-only. Both
are DCP's public extension points (a ``StorageReader`` and a ``LoadPlanner``); anything else in a
file ends in one :class:`~zerotrain.errors.UserError` line naming it.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from zerotrain.errors import UserError
from zerotrain.train.state import RESUME, unreadable

FOLDER = "dcp"
"""The subfolder of a step folder that holds the DCP checkpoint."""

METADATA = ".metadata"

MODEL, OPTIMIZER = "model", "optimizer"
"""The two top-level keys of the saved state (DCP flattens nested keys as ``model.<parameter name>``)."""

STATE_FILE = "fsdp2_state.pt"
"""Beside ``dcp/``: the schedule's state (the same on every rank), written by rank 0."""

Place = tuple[Any, ...]
"""A value's place in the saved state, as DCP records it: ``("optimizer", "state", "<parameter>", "exp_avg")``."""

METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: torch.strided
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
})
"""What a ``.metadata`` file that torch 2.13's ``dcp.save`` wrote names, and nothing that runs code when called
with its recorded arguments: record classes (dataclasses and an enum), a layout by name, a path. torch's dtypes
(``torch.float32``) are admitted by value."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "pathlib._local":  # Python 3.13 pickles pathlib's classes under their private module
            module = "pathlib"
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def read_metadata(path: Path, where: tuple[str, str] = RESUME) -> Metadata:
    """``path`` (a ``.metadata`` file) unpickled with only :data:`METADATA_GLOBALS` and dtypes; one line otherwise.

    Parsed once while the file stays as it is (same file, size, modification and change times): reading a
    checkpoint one tensor at a time (a conversion, an export) asks for it for every tensor, and it grows with the
    tensors. The file's inode and change time are part of the key, so a file replaced by one of the same size
    whose modification time was carried over (``cp -p``, ``rsync -t``, a rename over it) is parsed again."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{where[0]}{path} is missing: the folder holds no DCP checkpoint. {where[1]}") from None
    except OSError as exc:  # a file where a folder of the path should be, no permission
        raise UserError(f"{where[0]}{path} cannot be loaded ({type(exc).__name__}: {exc.strerror}). "
                        f"{where[1]}") from None
    return _parsed_metadata(str(path), (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size), where)


@functools.lru_cache(maxsize=4)
def _parsed_metadata(path: str, version: tuple[int, ...], where: tuple[str, str]) -> Metadata:
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{where[0]}{path} is missing: the folder holds no DCP checkpoint. {where[1]}") from None
    except Exception as exc:  # UnpicklingError, EOFError, ... of a damaged or crafted file
        why = ("it names Python objects other than DCP's records, which are refused because loading them could "
               "run code (was the file replaced?)" if "Unsupported global" in str(exc)
               else f"it is damaged ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
        raise UserError(f"{where[0]}{path} cannot be loaded: {why}. {where[1]}") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"{where[0]}{path} cannot be loaded: it is not DCP metadata. {where[1]}")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by :func:`read_metadata` (tensors it already reads weights-only)."""

    def __init__(self, path: Path, where: tuple[str, str] = RESUME):
        super().__init__(str(path))
        self._folder, self._where = Path(path), where

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._folder / (METADATA if rank is None else f"__{rank}{METADATA}")
        if rank is not None and not path.is_file():
            # DCP asks for a rank's own metadata first and falls back to the global file on this error
            raise FileNotFoundError(path)
        metadata = read_metadata(path, self._where)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with every non-tensor value read weights-only first.

    The value is loaded with ``torch.load(weights_only=True)`` (plain containers, numbers, strings), then
    saved again and handed to the default planner, whose own load of those bytes can only find what the
    weights-only load already admitted."""

    def __init__(self, source: Path, where: tuple[str, str] = RESUME):
        super().__init__()
        self._source, self._where = source, where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise unreadable(self._source, exc, self._where) from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def _first_failure(exc: CheckpointException) -> BaseException:
    """The error behind DCP's report (every rank gets all of them): a UserError first, else the first one. DCP's
    CheckpointException is a BaseException, which the callers' one-line handling (OSError for a full disk) and
    the CLI's would let through as a traceback."""
    errors = [e for e, _ in exc.failures.values()]
    return next((e for e in errors if isinstance(e, UserError)), errors[0] if errors else RuntimeError(str(exc)))


def save(state: dict[str, Any], folder: Path) -> None:
    """Write ``state`` (DTensor shards, tensors, plain values) into ``folder/dcp``. Collective; a failed write
    raises the rank's own error (OSError for a full disk), as the other engines' saves do."""
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(folder / FOLDER)))
    except CheckpointException as exc:
        raise _first_failure(exc) from None


def load(state: dict[str, Any], folder: Path, where: tuple[str, str] = RESUME, no_dist: bool = False) -> None:
    """Fill ``state`` (the same keys as saved, tensors or DTensors of this run's sharding) in place from
    ``folder/dcp``; DCP reads each rank's slices whatever process count wrote them. Collective unless ``no_dist``."""
    path = folder / FOLDER
    read_metadata(path / METADATA, where)  # its one line here: inside dcp.load every error becomes DCP's report
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist: what was asked
            dcp.load(state, storage_reader=SafeReader(path, where), planner=SafePlanner(path, where), no_dist=no_dist)
    except CheckpointException as exc:
        first = _first_failure(exc)  # the first refusal any rank met, as its one line
        if isinstance(first, UserError):
            raise first from None
        # a shard file cut short or emptied (its marker rewritten with it): EOFError, a short read, ... from DCP's
        # reader, which does not say which file; the folder is named
        raise unreadable(path, first, where) from None


def model_tensors(folder: Path, where: tuple[str, str] = RESUME
                  ) -> dict[str, tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]]:
    """name -> (shape, dtype, thunk) of the model's full tensors in ``folder/dcp``, without a process group; each
    thunk reads one tensor from every shard file that holds a slice of it (host memory: one tensor at a time)."""
    metadata = read_metadata(folder / FOLDER / METADATA, where)
    prefix = MODEL + "."
    out: dict[str, tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            name = key[len(prefix):]
            out[name] = (meta.size, meta.properties.dtype, _reader(folder, name, meta, where))
    if not out:
        raise UserError(f"{where[0]}{folder / FOLDER / METADATA} lists no model weights. {where[1]}")
    return out


def _reader(folder: Path, name: str, meta: TensorStorageMetadata, where: tuple[str, str]
            ) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        return read_values(folder, {(MODEL, name): meta}, where)[(MODEL, name)]
    return read


def entries(folder: Path, where: tuple[str, str] = RESUME) -> dict[Place, Any]:
    """Every value saved in ``folder/dcp`` by its place in the saved state (:data:`Place`) -> its DCP storage
    metadata (``TensorStorageMetadata``: shape and dtype; ``BytesStorageMetadata``: a plain value)."""
    metadata = read_metadata(folder / FOLDER / METADATA, where)
    places = metadata.planner_data
    if not isinstance(places, dict):
        raise UserError(f"{where[0]}{folder / FOLDER / METADATA} does not record where its values belong (not "
                        f"written by DCP's default planner). {where[1]}")
    return {tuple(places[key]): meta for key, meta in metadata.state_dict_metadata.items() if key in places}


def read_values(folder: Path, wanted: dict[Place, Any], where: tuple[str, str] = RESUME) -> dict[Place, Any]:
    """The values at ``wanted``'s places (with their metadata from :func:`entries`): tensors whole, however many
    ranks wrote slices of them, and plain values (read weights-only). Without a process group; the caller
    chooses how much to read at once."""
    state: dict[str, Any] = {}
    for place, meta in wanted.items():
        _put(state, place, torch.empty(meta.size, dtype=meta.properties.dtype)
             if isinstance(meta, TensorStorageMetadata) else None)
    load(state, folder, where, no_dist=True)
    return {place: _get(state, place) for place in wanted}


def _put(state: Any, place: Place, leaf: Any) -> None:
    """Set ``leaf`` at ``place`` in nested dicts and lists (a list where DCP recorded an index), creating them."""
    node = state
    for part, nxt in zip(place, place[1:]):
        fresh: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            node[part] = fresh if node[part] is None else node[part]
            node = node[part]
        else:
            node = node.setdefault(part, fresh)
    if isinstance(node, list):
        node.extend([None] * (place[-1] + 1 - len(node)))
    node[place[-1]] = leaf


def _get(state: Any, place: Place) -> Any:
    for part in place:
        state = state[part]
    return state
