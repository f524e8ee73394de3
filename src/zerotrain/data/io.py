"""Reading and writing data files, one way each, with one error format.

* :func:`open_text`, :func:`read_lines`, :func:`read_jsonl`, :func:`read_json`: UTF-8 text, plain or
  ``.gz`` / ``.xz`` / ``.bz2``. Lines are split on ``"\\n"`` only, never with ``str.splitlines()``
  (some IMDB reviews hold U+0085, which it would split on). Every problem is a
  :class:`~zerotrain.errors.DataError` whose message starts ``{path}:{line}:`` (or ``{path}:`` when
  no line applies) and says what to do, never a ``BadGzipFile`` or ``UnicodeDecodeError`` traceback.
* :func:`looks_local`, :func:`hub_offline`, :func:`load_hub_dataset`: a local path or a Hugging Face
  hub name, failing fast (no 25 s of retries) when the hub cannot be reached.
* :func:`atomic_file`, :func:`atomic_write_bytes`, :func:`atomic_write_text`, :func:`write_json`:
  write to a temporary file in the same folder, fsync, rename; a reader never sees half a file
  and a failed write leaves the old file in place.
* :func:`fingerprint`: the hash that names on-disk caches (texts, tokenizers, settings).

This module imports neither torch nor numpy, so that light modules (``rundir``) can use it.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import os
import secrets
import socket
import zlib
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, Iterator, Optional
from urllib.parse import urlsplit

from zerotrain.errors import DataError, UserError

# suffix -> (format name, magic bytes, binary opener)
_COMPRESSED: dict[str, tuple[str, bytes, Callable[..., BinaryIO]]] = {
    ".gz": ("gzip", b"\x1f\x8b", gzip.open),
    ".xz": ("xz", b"\xfd7zXZ\x00", lzma.open),
    ".bz2": ("bzip2", b"BZh", bz2.open),
}
_STREAM_ERRORS = (EOFError, zlib.error, lzma.LZMAError, OSError)  # BadGzipFile is an OSError
_UTF8_BOM = b"\xef\xbb\xbf"
_CHUNK_BYTES = 1 << 20

DATA_SUFFIXES = (".txt", ".raw", ".json", ".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".gz", ".xz", ".bz2")
"""A name ending in one of these is a file, never a hub name."""


# ---- reading -------------------------------------------------------------------------------------
def _sniff(head: bytes) -> str:
    """What the first bytes of a file look like, for error messages."""
    if not head:
        return "the file is empty"
    for suffix, (kind, magic, _) in _COMPRESSED.items():
        if head.startswith(magic):
            return f"it is {kind}-compressed ({suffix})"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not just a multi-byte character cut by the 8-byte window
            return f"it starts with bytes {head[:8]!r}, neither text nor a known compression"
    return "it looks like plain text"


def _open_binary(path: Path) -> tuple[BinaryIO, Optional[str]]:
    """Open ``path`` for reading bytes, decompressing by suffix after checking the magic bytes.

    Returns the stream and the compression's name (None for a plain file).
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file. Check the path") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a folder; pass a file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    suffix = path.suffix.lower()
    if suffix in _COMPRESSED:
        kind, magic, opener = _COMPRESSED[suffix]
        if not head.startswith(magic):
            raise DataError(
                f"{path}: not a {kind} file although its name ends in {path.suffix} ({_sniff(head)}). "
                f"Rename the file to match its content, or compress it with {kind}"
            )
        return opener(path, "rb"), kind
    for other, (kind, magic, _) in _COMPRESSED.items():
        if head.startswith(magic):
            raise DataError(
                f"{path}: the file is {kind}-compressed but its name does not end in {other}. "
                f"Rename it to {path.name}{other}"
            )
    return open(path, "rb"), None


@contextlib.contextmanager
def open_text(path: str | os.PathLike[str], newline: Optional[str] = "") -> Iterator[IO[str]]:
    """``with open_text(path) as f:`` reads UTF-8 text from a plain, ``.gz``, ``.xz`` or ``.bz2`` file.

    A leading byte-order mark is dropped. ``newline=""`` (the default) leaves line endings as they
    are; ``newline=None`` translates ``\\r\\n`` and ``\\r`` to ``\\n``. A missing file, a file whose
    content does not match its suffix, a corrupt compressed stream or bytes that are not UTF-8
    (also while reading inside the ``with`` block) raise :class:`DataError` naming the file.
    For line-by-line reading prefer :func:`read_lines`, which also names the line.
    """
    path = Path(path)
    raw, kind = _open_binary(path)
    try:
        with io.TextIOWrapper(raw, encoding="utf-8-sig", newline=newline) as f:
            yield f
    except UnicodeDecodeError as exc:
        raise DataError(_not_utf8(path, None, exc)) from None
    except _STREAM_ERRORS as exc:
        raise DataError(_broken_stream(path, None, kind, exc)) from None


def _not_utf8(path: Path, lineno: Optional[int], exc: UnicodeDecodeError) -> str:
    where = f"{path}:{lineno}" if lineno is not None else f"{path}"
    return (f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start + 1}{' of the line' if lineno else ''}). "
            "Save the file as UTF-8, or if it is compressed give it the matching .gz/.xz/.bz2 suffix")


def _broken_stream(path: Path, lineno: Optional[int], kind: Optional[str], exc: BaseException) -> str:
    where = f"{path}:{lineno}" if lineno is not None else f"{path}"
    what = f"the {kind} data is corrupt or truncated" if kind else "reading failed"
    return f"{where}: {what} ({type(exc).__name__}: {exc}). Copy or download the file again"


def _decode_line(data: bytes, path: Path, lineno: int) -> str:
    if b"\x00" in data:
        raise DataError(
            f"{path}:{lineno}: holds a NUL byte, so it is binary (or UTF-16) data, not UTF-8 text. "
            "Pass a UTF-8 text file (.txt, .jsonl, .csv), optionally compressed as .gz/.xz/.bz2"
        )
    if lineno == 1 and data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(_not_utf8(path, lineno, exc)) from None


def read_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """Yield ``(line number, line)`` of a UTF-8 text file (plain or compressed), numbered from 1.

    Lines are split on ``"\\n"`` only; a ``"\\r"`` before it stays at the end of the line. Blank
    lines are yielded too. Errors are :class:`DataError` ``"{path}:{line}: ..."``.
    """
    path = Path(path)
    raw, kind = _open_binary(path)
    lineno = 0
    with raw:
        rest = b""
        while True:
            try:
                chunk = raw.read(_CHUNK_BYTES)
            except _STREAM_ERRORS as exc:
                raise DataError(_broken_stream(path, lineno + 1, kind, exc)) from None
            if not chunk:
                break
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for part in parts:
                lineno += 1
                yield lineno, _decode_line(part, path, lineno)
        if rest:
            lineno += 1
            yield lineno, _decode_line(rest, path, lineno)


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, value)`` for each non-blank line of a JSON-lines file (plain or compressed).

    A line that is not JSON raises ``DataError("{path}:{line}: not valid JSON (...)")``.
    """
    for lineno, line in read_lines(path):
        if not line.strip():
            continue  # a trailing newline or a blank separator line is not a record
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}). "
                            "Each line must hold one JSON value") from None
        yield lineno, value


def read_json(path: str | os.PathLike[str], hint: str = "") -> Any:
    """The one JSON value a file (plain or compressed) holds; DataError ``"{path}:{line}: ..."`` otherwise.

    ``hint`` (what the file should hold) ends the message of an empty or malformed file.
    """
    with open_text(path) as f:
        text = f.read()
    hint = f". {hint}" if hint else ""
    if not text.strip():
        raise DataError(f"{path}: the file is empty{hint}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}){hint}") from None


# ---- local path or hub name ----------------------------------------------------------------------
def looks_local(name_or_path: str | os.PathLike[str]) -> bool:
    """True for a local file or folder (existing, or written as a path), False for a hub name.

    Hub names (``roberta-base``, ``stanfordnlp/imdb``) and relative paths (``data/imdb``) look alike;
    a name that exists on disk, starts with ``.``, ``/`` or ``~``, or ends in a data file suffix
    (``.txt``, ``.jsonl``, ``.gz``, ...) is taken as local.
    """
    name = os.fspath(name_or_path)
    return (name.startswith((".", "/", "~")) or name.lower().endswith(DATA_SUFFIXES)
            or Path(name).expanduser().exists())


_TRUE = {"1", "on", "yes", "true"}
_hub_reachable: Optional[bool] = None


def _probe_hub(timeout: float) -> bool:
    """Whether a TCP connection to the hub (or the configured proxy) opens within ``timeout`` seconds."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    target = (endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443))
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(var):
            proxy = urlsplit(os.environ[var] if "://" in os.environ[var] else f"http://{os.environ[var]}")
            if proxy.hostname:
                target = (proxy.hostname, proxy.port or 8080)
            break
    try:
        with socket.create_connection(target, timeout=timeout):
            return True
    except OSError:
        return False


def _set_offline() -> None:
    """Offline mode for huggingface_hub, datasets and transformers, also when they are already imported."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
        config.HF_DATASETS_OFFLINE = True


def hub_offline(timeout: float = 3.0) -> bool:
    """True when the Hugging Face hub must not be contacted, and then offline mode is switched on.

    Offline means ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` is set to a true
    value, or (when none of them is set at all) the hub's host does not accept a connection within
    ``timeout`` seconds (checked once per process). Offline mode makes ``datasets`` and
    ``transformers`` answer from the local cache at once, instead of retrying for 25 s or more; a
    variable set to a false value (``HF_HUB_OFFLINE=0``) skips the check.
    """
    global _hub_reachable
    values = [os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")]
    if any(v is not None and v.strip().lower() in _TRUE for v in values):
        _set_offline()
        return True
    if any(v is not None for v in values):
        return False
    if _hub_reachable is None:
        _hub_reachable = _probe_hub(timeout)
    if not _hub_reachable:
        _set_offline()
    return not _hub_reachable


def load_hub_dataset(name: str, split: str, flag: str, local_example: str):
    """``datasets.load_dataset`` of ``name`` (``dataset`` or ``dataset:config``), split ``split``.

    Any failure (offline, unknown name, missing split) becomes a :class:`UserError` naming ``flag``
    and saying to pass a local path, such as ``local_example``. With no network it fails within
    seconds (see :func:`hub_offline`); a dataset already in the local cache still loads.
    """
    dataset, _, config = name.partition(":")
    offline = hub_offline()
    try:
        import datasets

        with _quiet_hub_logs():
            return datasets.load_dataset(dataset, config or None, split=split)
    except Exception as exc:  # offline, unknown name, no such split: all fixed by passing a local path
        first = (str(exc).splitlines() or [""])[0][:200]
        why = f"{type(exc).__name__}: {first}"
        if offline:
            why = f"offline, as there is no network or HF_HUB_OFFLINE is set; {why}"
        raise UserError(
            f"{flag}: could not load the Hugging Face dataset {name!r}, split {split!r} ({why}). "
            f"Pass a local path instead, e.g. {flag} {local_example}"
        ) from None


@contextlib.contextmanager
def _quiet_hub_logs() -> Iterator[None]:
    """Keep huggingface_hub's and datasets' warnings (retries, cache fallbacks) off the console."""
    import logging

    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ---- writing -------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """``with atomic_file(path) as f:`` writes to a temporary file beside ``path``, then renames it.

    On leaving the block the data is flushed and fsynced and the file replaces ``path`` in one
    ``os.replace``, so readers (other ranks, other runs) see the old file or the new one, never half
    of one. If the block raises, the temporary file is removed and ``path`` is left as it was.
    The parent folder is created if needed; the file gets the usual permissions (umask applied).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (see :func:`atomic_file`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: Optional[int] = 2,
               default: Optional[Callable[[Any], Any]] = None, sort_keys: bool = False) -> None:
    """Write ``obj`` as JSON (plus a final newline) to ``path`` atomically.

    ``obj`` is serialised before anything is written, so a value json cannot encode raises
    ``TypeError`` and leaves the old file untouched. ``default=str`` writes such values as strings.
    """
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default, ensure_ascii=False) + "\n"
    atomic_write_text(path, text)


# ---- cache keys ----------------------------------------------------------------------------------
def fingerprint(*parts: Any, length: int = 24) -> str:
    """A hex digest identifying ``parts``, for naming caches.

    Each part may be a str, bytes, int, float, bool or None, a list/tuple of those (hashed item by
    item: a list of texts hashes their content), or a tokenizer (hashed by its full serialised form:
    vocabulary, merges, normaliser, added and special tokens). Parts are length-prefixed and typed,
    so ``("ab", "c")`` and ``("a", "bc")``, or ``"1"`` and ``1``, differ.
    """
    h = hashlib.sha256()
    for part in parts:
        _feed(h, part)
    return h.hexdigest()[:length]


def _feed(h: "hashlib._Hash", part: Any) -> None:
    if isinstance(part, str):
        tag, data = b"s", part.encode("utf-8", "surrogatepass")
    elif isinstance(part, bytes):
        tag, data = b"b", part
    elif part is None or isinstance(part, (bool, int, float)):
        tag, data = b"n", repr(part).encode()
    elif isinstance(part, (list, tuple)):
        h.update(b"l" + len(part).to_bytes(8, "little"))
        for item in part:
            _feed(h, item)
        return
    elif hasattr(part, "get_vocab"):
        tag, data = b"t", _tokenizer_identity(part)
    else:
        raise TypeError(f"fingerprint() cannot hash a {type(part).__name__}")
    h.update(tag + len(data).to_bytes(8, "little"))
    h.update(data)


def _tokenizer_identity(tokenizer: Any) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        # Truncation and padding are call-time state that the last call leaves behind, not identity.
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # a slow (Python) tokenizer: its vocabulary
        spec = sorted(tokenizer.get_vocab().items())
    specials = {
        "class": type(tokenizer).__name__,
        "len": len(tokenizer),
        "special_tokens": getattr(tokenizer, "special_tokens_map", {}),
        "special_ids": [getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk", "mask")],
    }
    return json.dumps([spec, specials], sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
