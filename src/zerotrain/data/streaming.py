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
* It runs in the training process (no DataLoader workers), so the position is that of the batches the step
  consumed, never of batches prefetched ahead of it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

from zerotrain.errors import DataError


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

    def __init__(self, open_stream: Callable[[], Any], make_rows: RowMaker, chunk: int, name: str):
        self.open_stream, self.make_rows, self.chunk, self.name = open_stream, make_rows, chunk, name

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
        for columns in raw.iter(batch_size=self.chunk):
            n = len(next(iter(columns.values())))
            made = self.make_rows(columns, list(range(first, first + n)))
            keys = list(made)
            count = len(made[keys[0]]) if keys else 0
            for r in range(consumed if first == start else 0, count):
                yield {k: made[k][r] for k in keys}, (first, r + 1)
            first += n

    def batches(self, micro_batch_size: int, rank: int, world_size: int, collate: Callable[[list], Any],
                epoch: int = 0, batches_in_epoch: int = 0, offset: Optional[Sequence[int]] = None) -> Iterator[Drawn]:
        """Micro-batches forever from (epoch, offset), each with the position after it."""
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
                raise DataError(f"{self.name}: process {rank}'s share of the stream holds fewer than "
                                f"{micro_batch_size} rows, not one micro-batch. Add data or lower "
                                "--trainer.micro_batch_size")
            epoch, batches_in_epoch, offset = epoch + 1, 0, None
