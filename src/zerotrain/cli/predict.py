"""``zerotrain predict RUN_DIR "review text" ... [--file TEXTS.txt] [--tokenizer DIR]``: classify reviews.

Loads the weights a finished ``zerotrain fit imdb`` run exported to ``RUN_DIR/model`` and prints
one line per text: label, probability, and the start of the text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.errors import UserError


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain predict", description=__doc__.split("\n\n")[1])
    parser.add_argument("run_dir", type=Path, help="a finished imdb run directory")
    parser.add_argument("texts", nargs="*", help="review texts")
    parser.add_argument("--file", type=Path, help="a file with one review per line")
    parser.add_argument("--tokenizer", help="tokenizer folder, when the run's own path no longer resolves")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    texts = list(args.texts)
    if args.file is not None:
        if not args.file.is_file():
            raise UserError(f"--file: {args.file} not found")
        texts += [line for line in args.file.read_text(encoding="utf-8").split("\n") if line.strip()]
    if not texts:
        raise UserError("give review texts as arguments or --file TEXTS.txt (one per line)")

    from zerotrain.tasks.imdb import predict

    for text, (label, prob) in zip(texts, predict(args.run_dir, texts, device=args.device, tokenizer=args.tokenizer)):
        snippet = text if len(text) <= 60 else text[:57] + "..."
        print(f"{label}\t{prob:.3f}\t{snippet}")
    return 0
