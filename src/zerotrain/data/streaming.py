"""A training split read as it is trained on (``--data.streaming true``), for corpora larger than host memory.

Design decisions:

* **Each rank reads its own share** of the raw records (``datasets.distributed.split_dataset_by_node``: whole
  files per rank when their number divides by the ranks, else every rank reads all and keeps one record in
  ``world_size``), in file order. Nothing is shuffled: a shuffle buffer would make the position below
  inexact; shuffle the corpus when writing it.
* **Rows are made per chunk** of ``chunk`` raw records (tokenized, and packed where the recipe packs): the
  same function the map-style path hands to ``Dataset.map`` with the same batch size, so packing never
  crosses a chunk and a chunk's rows depend on that chunk alone.
* **The position is (first record of the chunk, rows of it consumed)** in this rank's share. It is saved in
  the train state after every optimizer step's last micro-batch; a resumed run skips the raw records before
  the chunk (read, not tokenized), makes that chunk's rows again and drops the consumed ones, so it continues
  at the exact row the interrupted run would have read next. A resume must keep the number of processes.
* At the end of its share a rank starts its next epoch at once; rows that do not fill a micro-batch there
  are dropped. The run's length is ``--trainer.max_steps``: a stream's size is unknown until it is read.
* **The ranks agree before the first step** that every share yields a micro-batch (an all-reduce of a flag):
  a rank whose share is too small would otherwise stop alone and leave the others waiting in their first
  collective. Every rank then ends with the same line, naming the processes whose share was too small.
* It runs in the training process (no DataLoader workers), so the position is that of the batches the step
  consumed, never of batches prefetched ahead of it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from zerotrain.data import source
from zerotrain.errors import DataError
from zerotrain.runtime.collectives import all_reduce_sum, raise_any_rank_error


class Drawn(NamedTuple):
    """One training micro-batch and where the data stands after it."""

    epoch: int
    batches: int
    """Micro-batches this rank has consumed in ``epoch``, this one included (0 with ``epoch`` already the next
    one when it ended the epoch)."""
    batch: Any
    offset: Optional[tuple[int, int]] = None
    """Streaming: (first raw record of the chunk, rows of it consumed) in this rank's share; None otherwise."""


RowMaker = Callable[[dict[str, list], list[int]], dict[str, list]]
"""(a batch of raw records as columns, their indices in the share) -> rows as columns."""


class StreamedRows:
    """The rows of a streamed split. ``open_stream()`` returns the raw ``IterableDataset`` (all ranks' records);
    ``make_rows`` turns one chunk of it into rows; ``name`` names it in messages."""

    def __init__(self, open_stream: Callable[[], Any], make_rows: RowMaker, chunk: int, name: str,
                 read_error: Optional[Callable[[BaseException], DataError]] = None):
        self.open_stream, self.make_rows, self.chunk, self.name = open_stream, make_rows, chunk, name
        self.read_error = read_error
        """The one line for a record the reader cannot parse (a broken JSON line, a binary file)."""

    def share(self, rank: int, world_size: int):
        """This rank's raw records, in order."""
        from datasets.distributed import split_dataset_by_node

        stream = self.open_stream()
        return split_dataset_by_node(stream, rank, world_size) if world_size > 1 else stream

    def rows(self, rank: int, world_size: int, offset: Optional[Sequence[int]] = None) -> Iterator[tuple[dict, tuple[int, int]]]:
        """(row, offset after it) from ``offset`` to the end of this rank's share, once."""
        start, consumed = (int(offset[0]), int(offset[1])) if offset else (0, 0)
        raw = self.share(rank, world_size)
        if start:
            raw = raw.skip(start)
        first = start
        for columns in self._read(raw):
            n = len(next(iter(columns.values())))
            try:
                made = self.make_rows(columns, list(range(first, first + n)))
            except DataError as exc:
                exc.said_by_each_rank = True  # a record of this rank's share: the other ranks do not meet it
                raise
            keys = list(made)
            count = len(made[keys[0]]) if keys else 0
            for r in range(consumed if first == start else 0, count):
                yield {k: made[k][r] for k in keys}, (first, r + 1)
            first += n

    def _read(self, raw) -> Iterator[dict]:
        chunks = iter(raw.iter(batch_size=self.chunk))
        while True:
            try:
                with source.quiet_datasets():  # the builder logs its parse error before raising it
                    columns = next(chunks)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as exc:  # the builder's parse error (pyarrow, json) for a damaged file
                if self.read_error is None:
                    raise
                error = self.read_error(exc)
                error.said_by_each_rank = True
                raise error from None
            yield columns

    def batches(self, micro_batch_size: int, rank: int, world_size: int, collate: Callable[[list], Any],
                epoch: int = 0, batches_in_epoch: int = 0, offset: Optional[Sequence[int]] = None,
                device: torch.device = torch.device("cpu")) -> Iterator[Drawn]:
        """Micro-batches forever from (epoch, offset), each with the position after it.

        The first one is drawn when the first is asked for, and then every rank says whether its share made one
        (collectives: every rank must ask for its first micro-batch). If drawing it failed on any rank (a bad
        record in the first chunk of its share), every rank raises that error; if any share made none, every
        rank raises the same :class:`DataError`. So no rank is left waiting in the first step for one that
        stopped, whoever started the processes. A bad record met later ends its own rank, which says it."""
        drawn = self._batches(micro_batch_size, rank, world_size, collate, epoch, batches_in_epoch, offset)
        first, empty, failed = None, False, None
        try:
            first = next(drawn)
        except _EmptyShare:
            empty = True
        except Exception as exc:
            failed = exc
        raise_any_rank_error(failed)
        short = self._short_shares(empty, rank, world_size, device)
        if short:
            drawn.close()
            which = ", ".join(str(r) for r in short)
            raise DataError(f"--data.streaming: {self.name}: the share of process(es) {which} of {world_size} holds "
                            f"fewer than --trainer.micro_batch_size {micro_batch_size} rows, not one micro-batch "
                            "(each process reads whole files when their number divides by the processes, else "
                            "every n-th record). Give the stream more files or rows than processes (a number of "
                            "files the processes divide), or lower --trainer.micro_batch_size")
        yield first
        yield from drawn

    @staticmethod
    def _short_shares(empty: bool, rank: int, world_size: int, device: torch.device) -> list[int]:
        """The ranks whose share made no micro-batch, agreed by all (one all-reduce)."""
        dist = torch.distributed
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return [rank] if empty else []
        flags = all_reduce_sum({f"{r:06d}": float(empty and r == rank) for r in range(world_size)}, device)
        return [int(k) for k, v in sorted(flags.items()) if v > 0]

    def _batches(self, micro_batch_size: int, rank: int, world_size: int, collate: Callable[[list], Any],
                 epoch: int, batches_in_epoch: int, offset: Optional[Sequence[int]]) -> Iterator[Drawn]:
        while True:
            pending: list[dict] = []
            made_one = bool(batches_in_epoch)
            for row, after in self.rows(rank, world_size, offset):
                pending.append(row)
                if len(pending) == micro_batch_size:
                    batches_in_epoch += 1
                    made_one = True
                    yield Drawn(epoch, batches_in_epoch, collate(pending), after)
                    pending = []
            if not made_one:
                raise _EmptyShare()
            epoch, batches_in_epoch, offset = epoch + 1, 0, None


class _EmptyShare(Exception):
    """A rank's share made no micro-batch in a whole pass (turned into one agreed line by ``batches``)."""


def streamed_source(src: source.Source, cache_dir: Optional[str], make_rows: RowMaker, chunk: int,
                    keep: Optional[Callable[[dict], bool]] = None, limit: Optional[int] = None) -> StreamedRows:
    """``src``'s records read as a stream (a saved dataset is refused in one line): those ``keep`` accepts, the
    first ``limit`` of them, turned into rows ``chunk`` records at a time by ``make_rows``."""
    if src.saved:
        src.load(streaming=True)  # refuses, in one line

    def open_stream():
        stream = src.load(cache_dir, streaming=True)
        if keep is not None:
            stream = stream.filter(keep)
        return stream.take(limit) if limit is not None else stream

    return StreamedRows(open_stream, make_rows, chunk, f"{src.flag} {src.path}", src.stream_error)


def first_columns(src: source.Source, cache_dir: Optional[str]) -> list[str]:
    """The fields of a streamed source's first record (empty when it holds none), read without the rest."""
    try:
        with source.quiet_datasets():  # the builder logs its parse error before raising it
            first = next(iter(src.load(cache_dir, streaming=True)), None)
    except DataError:
        raise
    except Exception as exc:  # the builder's parse error for a damaged first file
        raise src.stream_error(exc) from None
    return sorted(first) if first else []


def share_where(src: source.Source):
    """``where(i)`` for a streamed record: its index in this process's share (files are not counted alone)."""
    def where(i: int) -> str:
        return f"{src.path}: record {i} of this process's share"
    return where


def documents(values: Sequence[Any], indices: Sequence[int], column: str, where: Callable[[int], str]) -> list[str]:
    """The non-blank documents among a batch's ``column`` values (None: a record without it, skipped); a value that
    is not a string is a :class:`DataError` naming the record (``where(index)``) and the flag that picks the field."""
    docs = []
    for value, i in zip(values, indices):
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where(i)}: {column!r} must be a string, got {type(value).__name__}; "
                            "set --data.text_field")
        if value.strip():
            docs.append(value)
    return docs
