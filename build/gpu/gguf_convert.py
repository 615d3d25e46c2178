"""Rebuild the default target's fp32 weights from its GGUF file alone (no transformers), so a
machine that cannot reach a package registry gets the exact `models/smollm2-135m-instruct`.

`dspark fetch-model` converts the GGUF with transformers' loader; this does the same with the
`gguf` package's numpy dequantizers (Q4_1 / Q8_0 / F32) and the same Q/K row un-permutation,
and `--check FOLDER` proves the result is bit-identical to a folder made by fetch-model.

    python build/gpu/gguf_convert.py GGUF OUT_FOLDER --meta-from FOLDER_FILES  # writes model.safetensors
    python build/gpu/gguf_convert.py GGUF --check models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch

NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of a Q or K projection [n_head·dim, in]."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def state_dict(gguf_file: Path) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors of a llama GGUF (the names and layout fetch-model writes)."""
    import gguf

    r = gguf.GGUFReader(str(gguf_file))
    field = lambda k: int(r.fields[k].parts[-1][0])  # noqa: E731
    n_head, n_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    out = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim > 1 or len(t.shape) > 1 else w
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if m:
            layer, part = m.groups()
            if part == "attn_q":
                w = _unpermute(w, n_head)
            elif part == "attn_k":
                w = _unpermute(w, n_kv)
            name = f"model.layers.{layer}.{NAMES[part]}.weight"
        else:
            name = NAMES[t.name.removesuffix(".weight")] + ".weight"
        out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path, nargs="?", help="folder to write model.safetensors into")
    p.add_argument("--check", type=Path, help="compare with this folder's model.safetensors, bit for bit")
    args = p.parse_args(argv)
    sd = state_dict(args.gguf)
    if args.check:
        from safetensors.torch import load_file

        ref = load_file(str(args.check / "model.safetensors"))
        bad = sorted(set(ref) ^ set(sd)) + [k for k in ref if k in sd and not torch.equal(ref[k], sd[k])]
        print(f"{len(sd)} tensors; {'identical' if not bad else f'{len(bad)} differ: {bad[:5]}'}")
        return 1 if bad else 0
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {args.out / 'model.safetensors'} ({len(sd)} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
