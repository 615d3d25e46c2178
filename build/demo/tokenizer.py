"""Train the demo byte-level BPE tokenizer on the corpus's train split, then tokenize every
split into flat uint16 token files (documents joined by EOS) for training and evaluation.

Special tokens get the first ids: EOS "<|endoftext|>" = 0, PAD "<|pad|>" = 1,
MASK "<|mask|>" = 2 (the drafters' block-filler token, docs/architecture.md §5).

    python build/demo/tokenizer.py [--corpus work/corpus] [--out work] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import read_jsonl  # noqa: E402

DOMAINS = ("code", "prose", "math")
SPLITS = ("train", "heldout")
EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, PAD, MASK]


def train_tokenizer(corpus: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [d["text"] for domain in DOMAINS for d in read_jsonl(corpus / f"{domain}.train.jsonl")]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenize_split(tok: Tokenizer, docs: list[dict]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by EOS."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([d["text"] for d in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=here / "work" / "corpus")
    ap.add_argument("--out", type=Path, default=here / "work")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    tok = train_tokenizer(args.corpus, args.vocab)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == [0, 1, 2], ids
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokens").mkdir(exist_ok=True)
    stats = {}
    for domain in DOMAINS:
        for split in SPLITS:
            docs = read_jsonl(args.corpus / f"{domain}.{split}.jsonl")
            arr = tokenize_split(tok, docs)
            arr.tofile(args.out / "tokens" / f"{domain}.{split}.bin")
            n_bytes = sum(len(d["text"].encode()) for d in docs)
            stats[f"{domain}.{split}"] = {"tokens": int(arr.size),
                                          "bytes_per_token": round(n_bytes / arr.size, 3)}
            print(f"{domain:6s} {split:8s} {arr.size:9d} tokens  {n_bytes / arr.size:.2f} bytes/token")
    (args.out / "tokens" / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")


if __name__ == "__main__":
    main()
