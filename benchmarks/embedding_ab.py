"""One in-process ``zerotrain fit`` with the token embedding's backward as zerotrain has it (``zerotrain``:
:class:`zerotrain.models.embedding.TokenEmbedding`, no read-back) or as torch has it (``torch``), to measure
what the read-back costs a step.

    python benchmarks/embedding_ab.py torch fit imdb --config configs/imdb_b.yaml ...
"""

from __future__ import annotations

import sys

from torch import nn

from zerotrain.cli import main
from zerotrain.models.embedding import TokenEmbedding

if __name__ == "__main__":
    variant, argv = sys.argv[1], sys.argv[2:]
    if variant not in ("zerotrain", "torch"):
        raise SystemExit(f"embedding_ab: the first argument is zerotrain or torch, not {variant!r}")
    if variant == "torch":
        TokenEmbedding.forward = nn.Embedding.forward
    sys.exit(main(argv))
