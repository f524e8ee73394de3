"""``zerotrain predict RUN_DIR TEXT... [--file TEXTS.txt] [--tokenizer DIR] [--device cpu] [--top_k K] [--max_new_tokens N]``.

Loads the model a finished ``zerotrain fit`` run exported to ``RUN_DIR/model`` and prints one line
per text: what the run's recipe predicts, a tab, and the start of the text. imdb: the label and its
probability; mlm: for each <mask> in the text, the --top_k likeliest tokens and their probabilities;
lora and causal-lm: the greedy continuation (at most --max_new_tokens tokens) of the text, prompted as the run
trained (its --data.template, or its chat template's user turn); classify: the label and its probability.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerotrain.errors import UserError
from zerotrain.runtime.rundir import load_run
from zerotrain.tasks.base import Task


def snippet(text: str, width: int = 60) -> str:
    """The start of ``text`` on one line, at most ``width`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerotrain predict", description=__doc__.split("\n\n")[1])
    parser.add_argument("run_dir", type=Path, help="a finished run directory (runs/<recipe>.<date>...)")
    parser.add_argument("texts", nargs="*", help="input texts (reviews; texts with <mask>; prompts' inputs)")
    parser.add_argument("--file", type=Path, help="a file with one text per line")
    parser.add_argument("--tokenizer", help="tokenizer folder, when the run's own path no longer resolves")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--top_k", type=int, default=5, help="mlm: candidates shown per <mask>")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="lora, causal-lm: most tokens generated per text")
    args = parser.parse_args(argv)
    for flag, value in (("--top_k", args.top_k), ("--max_new_tokens", args.max_new_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    texts = list(args.texts)
    if args.file is not None:
        if not args.file.is_file():
            raise UserError(f"--file: {args.file} not found")
        raw = args.file.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"--file: {args.file} is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}): "
                            "give a text file with one text per line") from None
        texts += [line for line in text.split("\n") if line.strip()]
    if not texts:
        raise UserError("give texts as arguments or --file TEXTS.txt (one per line)")


    loaded = load_run(args.run_dir, {"tokenizer": args.tokenizer} if args.tokenizer else None, device=args.device)

    if type(loaded.task).predict is Task.predict:
        raise UserError(f"{args.run_dir} is a run of the {loaded.recipe} recipe, which has nothing to predict "
                        f"(zerotrain predict knows imdb, mlm, lora, causal-lm and classify); its weights are in {args.run_dir}/model, "
                        f"or write them with zerotrain export {args.run_dir}")
    predictions = loaded.task.predict(loaded.model, texts, top_k=args.top_k, max_new_tokens=args.max_new_tokens)
    for text, prediction in zip(texts, predictions, strict=True):
        print(f"{prediction}\t{snippet(text)}")
    return 0
