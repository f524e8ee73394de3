"""Train a byte-level BPE tokenizer on a text file, for benchmark models whose vocabulary size is fixed by their
shape (a Llama-shaped model has 32,000 tokens) when no tokenizer of that size is at hand offline.

    python benchmarks/make_tokenizer.py DATA/gutenberg/train.txt.xz OUT_DIR --vocab 32000

OUT_DIR is a Hugging Face tokenizer folder (``AutoTokenizer.from_pretrained(OUT_DIR)``) with <unk>, <s> and
</s> as tokens 0, 1 and 2, as Llama's configs expect (bos 1, eos 2). Its merges depend only on the text.
"""

from __future__ import annotations

import argparse
import lzma
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text", help="a .txt or .txt.xz file, one document a line")
    p.add_argument("out")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max_lines", type=int, default=None, help="train on the first N lines only")
    args = p.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    opener = lzma.open if args.text.endswith(".xz") else open

    def lines():
        with opener(args.text, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if args.max_lines is not None and i >= args.max_lines:
                    return
                if line.strip():
                    yield line.rstrip("\n")

    special = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(args.out)
    print(f"{args.out}: {len(fast)} tokens")


if __name__ == "__main__":
    main()
