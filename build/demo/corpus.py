"""Build the three-domain demo corpus (code, prose, math), split into train / held-out by
document, deterministically (docs/architecture.md §8: prompts for drafter training come from here).

- code: the running interpreter's standard library source (`sysconfig` stdlib path),
  test packages excluded. Different machines ship slightly different trees, so the
  manifest records every file's path and sha256.
- prose: the reStructuredText sources of the Python documentation (Debian's
  python3.11-doc puts them under /usr/share/doc/python3.11/html/_sources).
- math: grade-school word problems with step-by-step solutions from `math_problems.py`;
  train and held-out come from different generator seeds.

A document goes to held-out when a hash of its name falls in the held-out bucket, so the
split does not depend on file order. Output: work/corpus/{domain}.{train,heldout}.jsonl
(one {"id", "text"} per line), the manifest (every source file's path, sha256 and split,
the corpus files' hashes) to work/corpus/manifest.json and the shipped
corpus_manifest.json, and the shipped eval prompt files prompts/{math,prose}.jsonl
(prefixes of held-out documents, read by dspark.tools.prompts).

    python build/demo/corpus.py [--out build/demo/work/corpus]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from math_problems import generate_problems  # noqa: E402

DOCS_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_PERCENT = 10  # of source files, by name hash
CODE_TRAIN_BYTES = 2_500_000
PROSE_TRAIN_BYTES = 2_500_000
MATH_TRAIN_PROBLEMS = 8000
MATH_HELDOUT_PROBLEMS = 500
MATH_TRAIN_SEED, MATH_HELDOUT_SEED = 1234, 98765
N_PROMPTS = 80  # per shipped prompt file
PROMPT_CHARS = 600
CHUNK_BYTES = 12_000  # long files become several documents (cut at blank lines), all in the file's split
TEST_PARTS = {"test", "tests", "idle_test", "testing"}
SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "ensurepip", "pydoc_data", "encodings"}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_heldout(name: str) -> bool:
    return int(sha256(name.encode())[:8], 16) % 100 < HELDOUT_PERCENT


def order_key(name: str) -> str:
    """A fixed pseudo-random order (so a byte cap samples the whole tree, not its first letters)."""
    return sha256(b"order:" + name.encode())


def code_files(stdlib: Path) -> list[Path]:
    out = []
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib)
        parts = set(rel.parts[:-1])
        if parts & (TEST_PARTS | SKIP_PARTS) or rel.name.startswith("test_") or rel.name.endswith("_test.py"):
            continue
        out.append(p)
    return out


def chunks(text: str, limit: int = CHUNK_BYTES) -> list[str]:
    """Greedy split at blank lines into pieces of at most ~limit characters."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > limit:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return [c.strip() for c in out if len(c.strip()) >= 200]


def split_files(files: list[Path], root: Path, train_cap: int, domain: str) -> tuple[list, list, list]:
    """-> (train docs, held-out docs, manifest rows). Held-out gets its share of the cap."""
    train, heldout, manifest = [], [], []
    caps = {"train": train_cap, "heldout": train_cap * HELDOUT_PERCENT // (100 - HELDOUT_PERCENT)}
    used = {"train": 0, "heldout": 0}
    for p in sorted(files, key=lambda p: order_key(str(p.relative_to(root)))):
        name = str(p.relative_to(root))
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        split = "heldout" if is_heldout(name) else "train"
        pieces = chunks(text.strip())
        if used[split] >= caps[split] or not pieces:
            continue
        used[split] += sum(len(c.encode()) for c in pieces)
        docs = heldout if split == "heldout" else train
        docs += [{"id": f"{domain}/{name}#{i}", "text": c} for i, c in enumerate(pieces)]
        manifest.append({"path": name, "sha256": sha256(raw), "split": split})
    return train, heldout, manifest


def prose_prompts(docs: list[dict], n: int, chars: int = PROMPT_CHARS) -> list[str]:
    """n prefixes of about `chars` characters starting at paragraph starts of held-out
    documents, taken round-robin over documents (at most one per 2 * chars of text)."""
    per_doc = []
    for d in docs:
        text, starts, last = d["text"], [0], 0
        for i in range(len(text) - 2):
            if text[i:i + 2] == "\n\n" and i + 2 - last >= 2 * chars and len(text) - i > chars:
                starts.append(i + 2)
                last = i + 2
        per_doc.append([text[s:s + chars].rsplit(" ", 1)[0] for s in starts])
    out: list[str] = []
    for k in range(max(len(p) for p in per_doc)):
        out += [p[k] for p in per_doc if k < len(p)]
    return out[:n]


def math_prompts(docs: list[dict], n: int) -> list[str]:
    """The question part of held-out problems, ending with "Answer:" (the model writes the solution)."""
    return [d["text"].split("\nAnswer:")[0] + "\nAnswer:" for d in docs[:n]]


def write_jsonl(path: Path, docs: list[dict]) -> None:
    with path.open("w") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build(out: Path, prompt_dir: Path, manifest_copy: Path | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not DOCS_SOURCES.is_dir():
        raise SystemExit(f"{DOCS_SOURCES} missing: install the docs with `apt-get install -y python3.11-doc`")
    manifest: dict = {"python": sys.version.split()[0], "stdlib": str(stdlib), "docs": str(DOCS_SOURCES),
                      "heldout_percent": HELDOUT_PERCENT, "domains": {}}
    code_tr, code_ho, code_man = split_files(code_files(stdlib), stdlib, CODE_TRAIN_BYTES, "code")
    prose_files = sorted(DOCS_SOURCES.rglob("*.txt"))
    prose_tr, prose_ho, prose_man = split_files(prose_files, DOCS_SOURCES, PROSE_TRAIN_BYTES, "prose")
    math_tr = [{"id": f"math/train/{i}", "text": t}
               for i, t in enumerate(generate_problems(MATH_TRAIN_PROBLEMS, MATH_TRAIN_SEED))]
    math_ho = [{"id": f"math/heldout/{i}", "text": t}
               for i, t in enumerate(generate_problems(MATH_HELDOUT_PROBLEMS, MATH_HELDOUT_SEED))]
    splits = [("code", code_tr, code_ho, code_man), ("prose", prose_tr, prose_ho, prose_man),
              ("math", math_tr, math_ho, None)]
    for domain, tr, ho, files in splits:
        write_jsonl(out / f"{domain}.train.jsonl", tr)
        write_jsonl(out / f"{domain}.heldout.jsonl", ho)
        info = {s: {"documents": len(d), "bytes": sum(len(x["text"].encode()) for x in d),
                    "sha256": sha256((out / f"{domain}.{s}.jsonl").read_bytes())}
                for s, d in (("train", tr), ("heldout", ho))}
        if files is not None:
            info["files"] = files
        else:
            info["seeds"] = {"train": MATH_TRAIN_SEED, "heldout": MATH_HELDOUT_SEED}
        manifest["domains"][domain] = info
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest_copy is not None:
        manifest_copy.write_text(json.dumps(manifest, indent=1) + "\n")
    prompt_dir.mkdir(parents=True, exist_ok=True)
    for domain, prompts in (("math", math_prompts(math_ho, N_PROMPTS)),
                            ("prose", prose_prompts(prose_ho, N_PROMPTS))):
        write_jsonl(prompt_dir / f"{domain}.jsonl", [{"prompt": p} for p in prompts])
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = Path(__file__).resolve().parent
    ap.add_argument("--out", type=Path, default=here / "work" / "corpus")
    ap.add_argument("--prompts", type=Path, default=here / "prompts", help="where the eval prompt files go")
    ap.add_argument("--manifest", type=Path, default=here / "corpus_manifest.json",
                    help="shipped copy of the manifest (file lists and hashes)")
    args = ap.parse_args()
    manifest = build(args.out, args.prompts, args.manifest)
    for domain, info in manifest["domains"].items():
        tr = info["train"]
        print(f"{domain:6s} train {tr['documents']:5d} docs {tr['bytes'] / 1e6:5.2f} MB | "
              f"held-out {info['heldout']['documents']:4d} docs {info['heldout']['bytes'] / 1e6:5.2f} MB")


if __name__ == "__main__":
    main()
