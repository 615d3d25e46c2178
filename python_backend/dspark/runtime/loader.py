"""Read and write Hugging Face checkpoint folders (docs/architecture.md §4).

A folder holds config.json, model.safetensors (or a sharded model.safetensors.index.json),
tokenizer.json and generation_config.json. Loading checks every tensor's name and shape
before any is assigned, so a bad checkpoint raises ValueError and nothing is half-loaded.
`save_pretrained` writes a folder that both this loader and transformers read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from dspark.runtime.config import ModelConfig, rope_inv_freq
from dspark.runtime.model import Transformer

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints store RoPE tables; we recompute them


def hf_to_ours(name: str) -> str:
    """HF parameter name -> ours (ours mirror HF without the `model.` prefix)."""
    if name == "lm_head.weight":
        return "lm_head_proj.weight"
    return name.removeprefix("model.")


def ours_to_hf(name: str) -> str:
    if name == "lm_head_proj.weight":
        return "lm_head.weight"
    return "model." + name


def load_config(folder: str | Path) -> ModelConfig:
    """config.json, with eos/bos/pad ids from generation_config.json when it has them."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    cfg = ModelConfig.from_json(folder / "config.json")
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        eos = gen.get("eos_token_id")
        if eos is not None:
            eos = [eos] if isinstance(eos, int) else list(eos)
            cfg.eos_token_ids = list(dict.fromkeys([int(e) for e in eos] + cfg.eos_token_ids))
        for key in ("bos_token_id", "pad_token_id"):
            if gen.get(key) is not None and getattr(cfg, key) is None:
                setattr(cfg, key, int(gen[key]))
    return cfg


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {f.name} listed in the index is missing from {folder}")
    return files


def read_state_dict(folder: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint under our names, checked against the model cfg describes."""
    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    found: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(IGNORED_SUFFIXES):
                    continue
                name = hf_to_ours(hf_name)
                if name == "lm_head_proj.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the LM head is the embedding matrix
                if name not in expected:
                    raise ValueError(f"unexpected tensor {hf_name!r} in {path.name} for a "
                                     f"{cfg.model_type} model")
                t = f.get_tensor(hf_name)
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise ValueError(f"tensor {hf_name!r} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(expected[name].shape)}")
                found[name] = t
    missing = [ours_to_hf(n) for n in expected if n not in found]
    if missing:
        raise ValueError(f"checkpoint {folder} is missing tensor(s): {', '.join(missing[:5])}"
                         + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    return found


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               num_taps: int = 3, tap_layers: list[int] | None = None) -> tuple[Transformer, ModelConfig]:
    """-> (Transformer in eval mode on device/dtype, its config). Raises before building on bad input."""
    cfg = load_config(folder)
    state = read_state_dict(folder, cfg)
    with torch.device("meta"):
        model = Transformer(cfg, tap_layers=tap_layers, num_taps=num_taps)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)  # non-persistent buffer, still on meta
    model = model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False), cfg


def round_params_(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Round every floating parameter to `dtype`'s precision in place, each keeping its own dtype:
    bf16 weights computed in fp32 (`dspark.wiring.torch_dtypes`). Buffers (the RoPE frequencies)
    keep their precision."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.copy_(p.to(dtype))
    return module


def save_pretrained(model: Transformer, config: ModelConfig, folder: str | Path,
                    tokenizer_path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write an HF folder (config, safetensors, generation config, tokenizer) that our
    loader and transformers' AutoModelForCausalLM both load."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_cfg = config.to_hf_dict()
    hf_cfg["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    state = {ours_to_hf(k): v.detach().to("cpu", dtype).clone(memory_format=torch.contiguous_format)
             for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    eos = config.eos_token_ids
    gen = {"bos_token_id": config.bos_token_id, "pad_token_id": config.pad_token_id,
           "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_path is not None:
        tok_src = Path(tokenizer_path)
        if tok_src.is_dir():
            tok_src = tok_src / "tokenizer.json"
        if tok_src.resolve() != (folder / "tokenizer.json").resolve():
            shutil.copyfile(tok_src, folder / "tokenizer.json")
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        name = lambda i: tok.id_to_token(i) if i is not None else None
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(config.bos_token_id),
                   "eos_token": name(eos[0] if eos else None), "pad_token": name(config.pad_token_id)}
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return folder


class _Weight:
    """A bare `.weight` holder, shaped like the nn.Module attributes drafters read."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


class SharedWeights:
    """What a drafter shares with its target, without the target: the embedding, the LM head
    (None when tied) and the final norm, read from the checkpoint alone, plus the tap layers
    and sizes. A drafter running in its own process (the Triton `drafter` model) loads this
    instead of a whole second target (for SmolLM2: ~57 MB instead of ~650 MB with KV slots)."""

    NAMES = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")

    def __init__(self, folder: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, num_taps: int = 3,
                 weights_dtype: torch.dtype | None = None) -> None:
        """`weights_dtype`: round the tensors to it, kept in `dtype` (as `TargetEngine` does)."""
        from dspark.runtime.model import default_tap_layers

        cfg = load_config(folder)
        found: dict[str, torch.Tensor] = {}
        for path in _weight_files(Path(folder)):
            with safe_open(str(path), framework="pt") as f:
                for name in set(self.NAMES) & set(f.keys()):
                    found[name] = f.get_tensor(name).to(device=device, dtype=weights_dtype or dtype).to(dtype)
        need = [n for n in self.NAMES if n != "lm_head.weight" or not cfg.tie_word_embeddings]
        missing = [n for n in need if n not in found]
        if missing:
            raise ValueError(f"checkpoint {folder} is missing tensor(s): {', '.join(missing)}")
        self.config = cfg
        self.weights_dtype = weights_dtype or dtype
        self.vocab_size = cfg.vocab_size
        self.device = torch.device(device)
        self.tap_layers = default_tap_layers(cfg.num_hidden_layers, num_taps)
        self.embed_tokens = _Weight(found["model.embed_tokens.weight"])
        self.lm_head_proj = None if cfg.tie_word_embeddings else _Weight(found["lm_head.weight"])
        self.norm = _Weight(found["model.norm.weight"])
