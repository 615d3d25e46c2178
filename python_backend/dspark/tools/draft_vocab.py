"""`dspark draft-vocab`: the draft vocabulary of a model's DSpark drafters (architecture §5).

The drafter's step is dominated by one read: its LM head, V rows of the target's embedding
(49152 × 576 for SmolLM2, 57 MB in bf16, about a fifth of the whole target step). Drafting over
the K tokens the target actually writes most (frequency-ranked, as FR-Spec does) reads K rows
instead. Tokens outside get draft probability 0; verification stays exact for any draft
distribution, so this trades a little acceptance for a cheaper step, and `dspark bench` measures
both sides.

Counts come from the target's own responses in drafter training data (`dspark train
--make-data` shards: tokens after each prompt), or from texts (a JSONL with "prompt"/"text").
Writes draft_vocab.json {"ids": [...], "size", "coverage", "source", "counted_tokens"} into the
model's drafter folder, where every DSpark drafter of that model picks it up at load time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark.runtime.drafter.files import DRAFT_VOCAB_FILE, read_draft_vocab

__all__ = ["count_shards", "count_texts", "read_draft_vocab", "top_ids", "write_vocab"]


def count_shards(data_dir: Path, vocab_size: int) -> tuple[torch.Tensor, int]:
    """Token counts [V] of the responses (the tokens after each prompt) in shard_*.pt files."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    paths = sorted(Path(data_dir).glob("shard_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no shard_*.pt in {data_dir} (make them with `dspark train --make-data`)")
    total = 0
    for path in paths:
        shard = torch.load(path, weights_only=True)
        for seq, plen in zip(shard["tokens"].split(torch.diff(shard["offsets"]).tolist()),
                             shard["prompt_len"].tolist()):
            counts += torch.bincount(seq[plen:], minlength=vocab_size)
            total += seq.numel() - plen
    return counts, total


def count_texts(path: Path, tokenizer, vocab_size: int) -> tuple[torch.Tensor, int]:
    """Token counts [V] of the texts of a JSONL file ("text", "prompt" or "response" fields)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    total = 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text = next((row[k] for k in ("text", "response", "prompt") if isinstance(row.get(k), str)), None)
        if text is None:
            raise ValueError(f"{path}: a line without a 'text', 'response' or 'prompt' string")
        ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.int64)
        counts += torch.bincount(ids, minlength=vocab_size)
        total += ids.numel()
    return counts, total


def top_ids(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most counted ids (ties: lower id), plus `always` (e.g. the eos ids), sorted."""
    order = torch.argsort(-counts, stable=True)
    keep = set(order[:size].tolist()) | set(int(i) for i in always)
    return torch.tensor(sorted(keep), dtype=torch.int64)


def write_vocab(folder: Path, ids: torch.Tensor, counts: torch.Tensor, source: str, total: int) -> Path:
    coverage = float(counts[ids].sum()) / max(float(counts.sum()), 1.0)
    path = Path(folder) / DRAFT_VOCAB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"size": int(ids.numel()), "coverage": round(coverage, 5), "source": source,
                                "counted_tokens": int(total), "ids": ids.tolist()}) + "\n")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | demo | a model folder")
    p.add_argument("--size", type=int, default=4096, help="K: tokens in the draft vocabulary")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a drafter training-data folder (shard_*.pt): count the responses")
    src.add_argument("--texts", help="a JSONL file of texts to count")
    p.add_argument("--out", default=None, help="folder to write draft_vocab.json (default: the model's "
                                               "drafter folder)")


def main(args: argparse.Namespace) -> int:
    from dspark import paths, wiring
    from dspark.runtime.config import ModelConfig
    from dspark.runtime.text import load_tokenizer

    spec = wiring.Spec(model=args.model)
    folder = wiring.model_folder(spec.model)
    cfg = ModelConfig.from_json(folder / "config.json")
    relative = getattr(paths, "relative", lambda p: Path(p).name)  # repository-relative when available
    if args.data:
        counts, total = count_shards(Path(args.data), cfg.vocab_size)
        source = f"responses in {relative(args.data)}"
    else:
        counts, total = count_texts(Path(args.texts), load_tokenizer(folder), cfg.vocab_size)
        source = f"texts in {relative(args.texts)}"
    ids = top_ids(counts, args.size, cfg.eos_token_ids)
    out = Path(args.out) if args.out else wiring.DRAFTER_DIRS.get(spec.model_key or "", folder)
    path = write_vocab(out, ids, counts, source, total)
    cov = json.loads(path.read_text())["coverage"]
    print(f"{ids.numel()} ids cover {100 * cov:.2f}% of {total} counted tokens; wrote {relative(path)}")
    return 0
