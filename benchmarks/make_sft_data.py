"""Turn IMDB reviews into SFT records: prompt/target records for the LoRA benchmark (input: the review, target:
its label), or with --chat two-turn conversations for the packing benchmark (the user asks for a review of a
sentiment, the assistant writes the review; the user asks for its sentiment in one word, the assistant answers).

    python benchmarks/make_sft_data.py DATA/imdb/train.jsonl.gz OUT.jsonl --n 4000
    python benchmarks/make_sft_data.py DATA/imdb/train.jsonl.gz OUT.jsonl --n 8000 --chat --max_chars 6000
"""

from __future__ import annotations

import argparse
import gzip
import json


def prompt_record(text: str, label: int) -> dict:
    return {"input": f"Review: {text}\nSentiment:", "target": " positive" if label else " negative"}


def chat_record(text: str, label: int) -> dict:
    sentiment = "positive" if label else "negative"
    return {"messages": [
        {"role": "user", "content": f"Write a {sentiment} review of a movie you saw."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "In one word, is that review positive or negative?"},
        {"role": "assistant", "content": sentiment.capitalize() + "."},
    ]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("imdb_jsonl_gz")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--max_chars", type=int, default=1500, help="cut reviews to this many characters")
    p.add_argument("--chat", action="store_true", help="write {messages: [...]} conversations")
    args = p.parse_args()
    with gzip.open(args.imdb_jsonl_gz, "rt", encoding="utf-8", newline="\n") as f:
        rows = [json.loads(line) for line in f.read().split("\n") if line.strip()]
    # The file is sorted by label: interleave so any prefix is balanced.
    neg, pos = [r for r in rows if r["label"] == 0], [r for r in rows if r["label"] == 1]
    mixed = [r for pair in zip(neg, pos) for r in pair][: args.n]
    make = chat_record if args.chat else prompt_record
    with open(args.out, "w") as out:
        for r in mixed:
            # ~1,500 characters is ~350 RoBERTa tokens: the prompt fits in 512 with room for the target.
            text = r["text"].replace("<br />", " ")[: args.max_chars]
            out.write(json.dumps(make(text, r["label"])) + "\n")


if __name__ == "__main__":
    main()
