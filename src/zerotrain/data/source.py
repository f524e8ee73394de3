"""Data files through Hugging Face ``datasets``: one source layer for the recipes that read user data.

``--data.train_path`` / ``--data.val_path`` name a file, a glob (``data/*.jsonl``), a folder of data files, or
a folder written by ``Dataset.save_to_disk``. :func:`resolve` finds which, :meth:`Source.load` returns a
``datasets.Dataset`` (or an ``IterableDataset`` that reads as it goes, for corpora larger than host memory),
and :func:`cached_map` turns it into model inputs through ``Dataset.map`` under a fingerprint of everything
the result depends on, in ``--data.cache_dir``, so a second run (or a second process) reads the tokens back.

Design decisions:

* **Local builders only.** Files are read with ``datasets``' packaged ``json``, ``csv``, ``parquet`` and
  ``text`` builders (chosen by suffix, compression suffixes ``.gz``/``.xz``/``.bz2`` allowed) and saved
  datasets with ``load_from_disk``; a hub name is never looked up, whatever the path looks like.
* **One file at a time** for map-style datasets: each file is its own builder call and the results are
  concatenated, so a file that fails to parse is named, and a row index maps back to its file. The builder's
  error (a pyarrow or pandas traceback) is replaced by the line zerotrain's own reader of that format gives
  (:mod:`zerotrain.data.io`: ``{path}:{line}: not valid JSON ...``), read again only when something failed.
* **Row locations for errors.** :meth:`Source.where` names a row as the format counts it: ``{path}:{line}``
  for JSON lines, CSV and text, ``{path}: record {i}`` for a JSON list, ``{path}: row {n}`` for Parquet and
  saved datasets. A missing field is one line naming the first row without it and the flag to set.
* **The cache key needs no read.** A source's identity is each file's resolved path, size and modification
  time (a saved dataset: those of its files), so a cached tokenization is found without parsing the data.
  ``datasets``' own Arrow copies of the parsed files live under ``<cache_dir>/datasets``, beside the
  tokenized ones, so one flag decides where all of it goes.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from zerotrain.data.io import fingerprint, open_text, read_json, read_jsonl, read_lines
from zerotrain.errors import DataError, UserError

log = logging.getLogger("zerotrain")

_COMPRESSIONS = (".gz", ".xz", ".bz2")
BUILDERS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv", ".tsv": "csv",
            ".parquet": "parquet", ".txt": "text", ".raw": "text", ".text": "text"}
"""Data file suffix (after any compression suffix) -> the ``datasets`` builder that reads it."""
SUFFIXES = tuple(BUILDERS)
CACHE_FORMAT = 1
"""Part of every cache key: bump it when what a cached map holds changes meaning."""
_SAVED_MARKERS = ("state.json", "dataset_info.json")


def _plain_suffix(path: Path) -> str:
    name = path.name.lower()
    for compression in _COMPRESSIONS:
        name = name.removesuffix(compression)
    return Path(name).suffix


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return path.is_dir() and (all((path / m).is_file() for m in _SAVED_MARKERS)
                              or (path / "dataset_dict.json").is_file())


@dataclass
class Source:
    """Where a split's data lives: data files of one builder, or a saved dataset folder."""

    path: str
    """As the user wrote it."""
    flag: str
    """The flag that holds it, for messages."""
    builder: Optional[str]
    """json, csv, parquet or text; None for a saved dataset."""
    files: list[Path] = field(default_factory=list)
    """The data files in read order (a saved dataset: its folder alone)."""
    rows_per_file: list[int] = field(default_factory=list)
    """Rows of each file, known once :meth:`load` read them (map-style only)."""

    @property
    def saved(self) -> bool:
        return self.builder is None

    def identity(self) -> str:
        """Resolved path, size and modification time of every file: what a cache key needs, without a read."""
        files = self.files
        if self.saved:
            files = sorted(p for p in self.files[0].rglob("*") if p.is_file())
        parts = []
        for p in files:
            st = p.stat()
            parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        return "|".join(parts)

    # ---- reading ----------------------------------------------------------------------------------------------
    def load(self, cache_dir: Optional[str] = None, streaming: bool = False):
        """The rows as a ``datasets.Dataset`` (``IterableDataset`` with ``streaming``): one row per JSON record,
        CSV row, Parquet row or text line (column ``text``; blank lines kept, so row i is line i + 1)."""
        import datasets

        if self.saved:
            if streaming:
                raise UserError(f"{self.flag}: {self.path} is a saved dataset (save_to_disk), which is read from "
                                "memory-mapped Arrow files and needs no streaming. Drop --data.streaming, or pass the "
                                "data files themselves")
            return self._load_saved()
        builder_cache = None if cache_dir is None else str(Path(cache_dir).expanduser() / "datasets")
        if builder_cache is not None and not streaming:
            drop_damaged_copies(Path(builder_cache))
        with quiet_datasets():
            if streaming:
                return datasets.load_dataset(self.builder, data_files=[str(f) for f in self.files], split="train",
                                             streaming=True, cache_dir=builder_cache, **self._builder_options())
            parts, self.rows_per_file = [], []
            for file in self.files:
                self._check_not_empty(file)
                try:
                    part = datasets.load_dataset(self.builder, data_files=[str(file)], split="train",
                                                 cache_dir=builder_cache, **self._builder_options(file))
                except Exception as exc:  # the builders raise pyarrow/pandas/json errors wrapped in their own
                    raise self._read_error(file, exc) from None
                if len(part) == 0:
                    raise DataError(f"{file}: no records (the file is empty)")
                parts.append(part)
                self.rows_per_file.append(len(part))
            return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    def _builder_options(self, file: Optional[Path] = None) -> dict[str, Any]:
        """CSV/TSV: every cell a string as written (an empty cell missing), as Python's csv module reads it, so a
        column's type does not depend on what pandas guesses from a chunk, and "NA" or "1" stay text."""
        if self.builder != "csv" or not self.files:
            return {}
        file = file or self.files[0]
        sep = "\t" if _plain_suffix(file) == ".tsv" else ","
        options: dict[str, Any] = {"sep": sep, "keep_default_na": False, "na_values": [""]}
        header = _csv_header(file, sep)
        if header and len(set(header)) == len(header):
            import datasets

            options["features"] = datasets.Features({name: datasets.Value("string") for name in header})
        return options

    def _load_saved(self):
        import datasets

        folder = self.files[0]
        if (folder / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
            raise DataError(f"{self.flag}: {folder} holds a DatasetDict (splits: {splits}); pass one split's folder, "
                            f"e.g. {self.flag} {folder / (splits[0] if splits else 'train')}")
        try:
            ds = datasets.load_from_disk(str(folder))
        except Exception as exc:
            raise DataError(f"{folder}: not a readable saved dataset ({type(exc).__name__}: "
                            f"{(str(exc).splitlines() or [''])[0][:200]}). Save it again with Dataset.save_to_disk") \
                from None
        if len(ds) == 0:
            raise DataError(f"{folder}: no records (the saved dataset is empty)")
        self.rows_per_file = [len(ds)]
        return ds

    def _check_not_empty(self, file: Path) -> None:
        if file.stat().st_size == 0:
            raise DataError(f"{file}: no records (the file is empty)")

    def _read_error(self, file: Path, exc: BaseException) -> DataError:
        """The one line for a file a builder could not read: zerotrain's own reader of the format names the line
        when it finds the fault; otherwise the builder's first line of complaint."""
        suffix = _plain_suffix(file)
        try:
            if suffix in (".jsonl", ".ndjson"):
                for line, value in read_jsonl(file):
                    if not isinstance(value, dict):
                        raise DataError(f"{file}:{line}: expected a JSON object, got {type(value).__name__}. "
                                        "Each line must hold one record")
            elif suffix == ".json":
                read_json(file, hint="A .json file must hold one list of objects; use .jsonl for one object per line")
            elif self.builder == "csv":
                _scan_csv(file, self._builder_options(file)["sep"])
            elif self.builder == "text":
                for _ in read_lines(file):
                    pass
        except DataError as precise:
            return precise
        cause = exc.__cause__ or exc.__context__ or exc
        first = (str(cause).splitlines() or [""])[0][:200]
        hint = (" Each field must hold values of one type in every record" if self.builder == "json"
                else " Check that the file is what its suffix says")
        return DataError(f"{file}: cannot be read as {self.builder} ({type(cause).__name__}: {first}).{hint}")

    def stream_error(self, exc: BaseException) -> DataError:
        """The one line for a failure of the builder while streaming these files (which file it was reading, the
        builder does not say): the first file zerotrain's own reader finds a fault in, by file and line; else the
        builder's complaint about the first file. Files are read in order up to the first fault found."""
        first: Optional[DataError] = None
        for file in self.files:
            if not file.is_file():
                continue
            error = self._read_error(file, exc)
            if ": cannot be read as " not in str(error):
                return error
            first = first or error
        return first or DataError(f"{self.path}: cannot be read ({type(exc).__name__}: {exc})")

    # ---- locations --------------------------------------------------------------------------------------------
    def where(self, row: int) -> str:
        """Row ``row`` of the loaded dataset as the file counts it, for an error message."""
        for file, n in zip(self.files, self.rows_per_file):
            if row < n:
                return self._where_in(file, row)
            row -= n
        return f"{self.path}: row {row + 1}"

    def _where_in(self, file: Path, k: int) -> str:
        suffix = _plain_suffix(file)
        if self.saved or self.builder == "parquet":
            return f"{file}: row {k + 1}"
        if suffix == ".json":
            return f"{file}: record {k}"
        if suffix in (".jsonl", ".ndjson"):
            records = read_jsonl(file)
            with contextlib.closing(records):
                for i, (line, _) in enumerate(records):
                    if i == k:
                        return f"{file}:{line}"
        if self.builder == "csv":
            with open_text(file) as f:
                reader = csv.reader(f, delimiter=self._builder_options(file)["sep"])
                next(reader, None)  # the header
                data_rows = (r for r in reader if r)  # blank lines are no rows, for pandas as for csv.DictReader
                for i, _ in enumerate(data_rows):
                    if i == k:
                        return f"{file}:{reader.line_num}"
        return f"{file}:{k + 1}"

    def require_columns(self, columns: Sequence[str], needed: dict[str, str], dataset: Any = None) -> None:
        """Every field of ``needed`` (field -> the flag that names it) is a column, and (``dataset`` given) has no
        missing value: else one line naming the first row without it, its fields and the flag to set."""
        for name, flag in needed.items():
            if name not in columns:
                raise DataError(f"{self.where(0)}: missing field {name!r} (keys: {sorted(columns)}). "
                                f"Rename the field or set {flag}")
            if dataset is None:
                continue
            column = dataset.data.column(name)
            if column.null_count:
                import pyarrow.compute as pc

                row = int(pc.index(pc.is_null(column), True).as_py())
                record = dataset[row]
                keys = sorted(k for k, v in record.items() if v is not None)
                raise DataError(f"{self.where(row)}: missing field {name!r} (keys: {keys}). "
                                f"Rename the field or set {flag}")


def _csv_header(file: Path, sep: str) -> list[str]:
    try:
        with open_text(file) as f:
            return next(csv.reader(f, delimiter=sep), [])
    except (csv.Error, DataError):
        return []  # the read that follows names the fault


def _scan_csv(file: Path, sep: str) -> None:
    rows = 0
    with open_text(file) as f:
        reader = csv.reader(f, delimiter=sep)
        try:
            for row in reader:
                rows += bool(row)
        except csv.Error as exc:
            raise DataError(f"{file}:{reader.line_num}: not valid CSV ({exc})") from None
    if rows <= 1:
        raise DataError(f"{file}: no records (the file holds a header line only)")


def resolve(path: str, flag: str, saved_ok: bool = True) -> Source:
    """The :class:`Source` that ``path`` names: a data file, a glob, a folder of data files (read in name order) or
    a saved dataset folder. Every file of a source must be read by the same builder. Errors name ``flag``."""
    p = Path(path).expanduser()
    if glob.has_magic(str(p)):
        files = sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
        if not files:
            raise DataError(f"{flag}: {path}: the pattern matches no file. Check the path")
        return _of_files(path, flag, files)
    if not p.exists():
        raise DataError(f"{flag}: {path}: no such file or folder. Check the path")
    if is_saved_dataset(p):
        return Source(path, flag, None, [p])
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                       and _plain_suffix(f) in BUILDERS)
        if not files:
            raise DataError(f"{flag}: {path}: folder holds no data files ({', '.join(SUFFIXES)}, optionally "
                            ".gz/.xz/.bz2) and is not a saved dataset (save_to_disk)")
        return _of_files(path, flag, files)
    return _of_files(path, flag, [p])


def _of_files(path: str, flag: str, files: list[Path]) -> Source:
    kinds = {}
    for f in files:
        suffix = _plain_suffix(f)
        if suffix not in BUILDERS:
            raise DataError(f"{flag}: {f}: unsupported file type; use one of {', '.join(SUFFIXES)} "
                            "(optionally .gz/.xz/.bz2), or a saved dataset folder")
        kinds.setdefault(BUILDERS[suffix], f)
    if len(kinds) > 1:
        raise DataError(f"{flag}: {path}: mixes formats ({', '.join(f'{k}: {v.name}' for k, v in kinds.items())}); "
                        "pass files of one format")
    return Source(path, flag, next(iter(kinds)), files)


def check_cache_dir(cache_dir: Optional[str], flag: str = "--data.cache_dir") -> Optional[Path]:
    """The cache folder (created if missing), or None for no cache; a file in its place is one error line."""
    if cache_dir is None:
        return None
    p = Path(cache_dir).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag}: {cache_dir} is a file; pass a folder (created if missing) for the tokenized data")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag}: {cache_dir} cannot be created ({exc.strerror or exc}); pass a writable folder") \
            from None
    return p


def cache_key(*parts: Any) -> str:
    """The fingerprint a cached map is named by: ``CACHE_FORMAT`` and ``parts`` (the source's identity, the
    tokenizer, the recipe's settings)."""
    return fingerprint("source-map", CACHE_FORMAT, *parts, length=32)


def cached_map(dataset, fn: Callable[..., dict[str, list]], key: str, cache_dir: Optional[Path],
               name: str, batch_size: int = 1000, with_indices: bool = False):
    """``dataset.map(fn, batched=True)`` with the input columns removed, stored as ``<cache_dir>/<name>-<key>.arrow``
    under the fingerprint ``key``. ``with_indices``: ``fn`` also gets the rows' indices. ``fn`` may return fewer or more rows than it is given (packing does).

    Run it on the main process first (the loop's ``main_process_first``): it writes the file, and the other
    ranks, and later runs with the same key, open it instead of computing it. ``cache_dir`` None: computed in
    memory, nothing written.
    """

    if cache_dir is not None:
        file = cache_dir / f"{name}-{key}.arrow"
        found = _open_cached(file, rebuild=True)
        if found is not None:
            return found
    else:
        file = None
    with quiet_datasets():
        return dataset.map(fn, batched=True, batch_size=batch_size, with_indices=with_indices, remove_columns=dataset.column_names,
                           new_fingerprint=key, cache_file_name=None if file is None else str(file),
                           keep_in_memory=file is None, load_from_cache_file=True, desc=f"tokenizing {name}")


def cached_dataset(cache_dir: Optional[Path], name: str, key: str):
    """The dataset :func:`cached_map` stored under ``name`` and ``key``, or None: lets a caller skip loading."""

    if cache_dir is None:
        return None
    return _open_cached(cache_dir / f"{name}-{key}.arrow", rebuild=False)


def _cut_short(file: Path) -> bool:
    """Whether the Arrow stream ``file`` lacks its end marker (see :data:`ARROW_STREAM_END`)."""
    try:
        with open(file, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - len(ARROW_STREAM_END), 0))
            return f.read() != ARROW_STREAM_END
    except FileNotFoundError:
        return False


def drop_damaged_copies(builder_cache: Path) -> None:
    """Delete, with one warning each, the folders of ``datasets``' parsed copies under ``builder_cache`` that hold
    an Arrow file cut short, so the builder parses the data files again instead of reading a damaged copy (which
    fails naming the data file, or reads fewer rows with no error). Folders still being written
    (``.incomplete``) and ``downloads/`` are left alone. Reads the last 8 bytes of each file: cheap even for a large cache."""
    import shutil

    if not builder_cache.is_dir():
        return
    for file in sorted(builder_cache.rglob("*.arrow")):
        inside = file.relative_to(builder_cache)
        # downloads/ holds files as a user gave them (an Arrow IPC file ends otherwise): only parsed copies here
        if ".incomplete" in str(inside) or inside.parts[0] == "downloads" or not _cut_short(file):
            continue
        log.warning("the cached copy of the data in %s is damaged (%s is cut short): deleted it and reading the "
                    "data files again", file.parent, file.name)
        shutil.rmtree(file.parent, ignore_errors=True)


ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The last 8 bytes of every Arrow stream ``datasets`` writes (a continuation marker and a zero length)."""


def _open_cached(file: Path, rebuild: bool):
    """The tokenized rows stored in ``file``, or None when there is no such file or it is damaged.

    A file cut short (a full disk, a copy or a job killed at the wrong moment) either fails to read or, when
    cut between two record batches, reads as fewer rows with no error; both lack the stream's end marker, which
    ``datasets`` writes last. Decision: a damaged cache is a cache miss, not an error: with ``rebuild`` (the
    caller tokenizes again) the file is deleted with one warning naming it; without, it is left for that caller.
    Training never reads a damaged file, and the user has nothing to do.
    """
    import datasets

    if not file.is_file():
        return None
    problem = "it is cut short" if _cut_short(file) else None
    if problem is None:
        try:
            return datasets.Dataset.from_file(str(file))
        except Exception as exc:  # pyarrow raises OSError or ArrowInvalid for a damaged stream
            problem = f"it cannot be read: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if rebuild:
        log.warning("the tokenization cache %s is damaged (%s): deleted it and tokenizing again", file, problem)
        file.unlink(missing_ok=True)
    return None


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No progress bars or info lines from ``datasets`` within the block; both are as they were after."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.utils.logging.disable_progress_bar()
    logger.setLevel(logging.CRITICAL + 1)  # a builder logs the failure we turn into one line
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


class Rows:
    """A ``datasets.Dataset`` as the loop's samplers and the collators read it: ``rows[i]`` one row (a dict),
    ``rows[a:b]`` a list of rows (``Dataset`` slices give columns), ``len(rows)``; ``table`` is the dataset."""

    def __init__(self, table: Any):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.table[i] for i in range(*index.indices(len(self.table)))]
        return self.table[int(index)]
