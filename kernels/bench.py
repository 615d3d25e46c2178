"""Kernel benchmark at serving sizes (CUDA only): each Triton kernel vs its torch reference.

For every kernel and size it times both with triton.testing.do_bench (median ms), checks
the kernel against the reference on the same inputs, and reports achieved bytes/s against
the bytes the operation must move at minimum (each input read once, each output written
once). Writes results/kernels_<gpu>.json.

    python kernels/bench.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

VOCAB = 151_936  # Qwen3 vocabulary
REQUESTS = (1, 32, 256)
GAMMAS = (4, 16)


def timed(fn, rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median"))


def ragged_lengths(r: int, gamma: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, gamma + 1, (r,), generator=g)


def cu_from(lengths: torch.Tensor, dev: str) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = (lengths + 1).cumsum(0)
    return cu.to(dev)


def bench_rejection(r: int, gamma: int, rep_ms: int) -> dict:
    from dspark_kernels.reference import rejection_sample_ref
    from dspark_kernels.rejection import rejection_sample_triton

    dev, g = "cuda", torch.Generator().manual_seed(0)
    lengths = ragged_lengths(r, gamma, g)
    cu = cu_from(lengths, dev)
    n = int(cu[-1])
    p_d = torch.softmax(torch.randn(r, gamma, VOCAB, device=dev), -1)
    drafts = torch.multinomial(p_d.view(-1, VOCAB), 1).view(r, gamma)
    rows_r = torch.repeat_interleave(torch.arange(r), lengths + 1).to(dev)
    rows_j = (torch.arange(n, device=dev) - cu[rows_r]).clamp(max=gamma - 1)
    p_t = 0.8 * p_d[rows_r, rows_j] + 0.2 * torch.softmax(torch.randn(n, VOCAB, device=dev), -1)
    verified = torch.arange(gamma)[None, :] < lengths[:, None]
    q_flat = p_d[verified.to(dev)]  # [Σℓ, V]: only the verified rows (the flat contract)
    u = torch.rand(r, gamma + 1, device=dev)
    args = (p_t, drafts, q_flat, cu, u)
    ref, got = rejection_sample_ref(*args), rejection_sample_triton(*args)
    # Must move: the ℓ accepted-token probabilities (negligible) + the final p_t row and the
    # rejected row's p_d (read once each) per request.
    min_bytes = r * VOCAB * 4 * 2
    return {
        "kernel": "rejection", "R": r, "gamma": gamma, "V": VOCAB, "N": n,
        "matches_reference": bool(torch.equal(ref[1], got[1])),
        "triton_ms": timed(lambda: rejection_sample_triton(*args), rep_ms),
        "torch_ms": timed(lambda: rejection_sample_ref(*args), rep_ms),
        "min_bytes": min_bytes,
    }


def bench_attention(r: int, gamma: int, rep_ms: int, context: int = 2048) -> dict:
    from dspark_kernels.reference import varlen_attention_ref
    from dspark_kernels.varlen_attention import varlen_attention_triton

    dev, g = "cuda", torch.Generator().manual_seed(0)
    n_heads, n_kv, head_dim, dtype = 32, 8, 128, torch.bfloat16  # Qwen3-8B attention shape
    max_len = context + gamma + 1
    k_cache = torch.randn(r, n_kv, max_len, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn(r, n_kv, max_len, head_dim, device=dev, dtype=dtype)
    lengths = ragged_lengths(r, gamma, g)
    cu = cu_from(lengths, dev)
    positions = torch.cat([torch.arange(context, context + int(n) + 1) for n in lengths]).to(dev)
    slots = torch.randperm(r, generator=g).to(dev)
    q = torch.randn(int(cu[-1]), n_heads, head_dim, device=dev, dtype=dtype)
    args = (q, k_cache, v_cache, cu, positions, slots)
    max_new = int(lengths.max()) + 1
    ref, got = varlen_attention_ref(*args), varlen_attention_triton(*args, max_new_tokens=max_new)
    kv_positions = int((lengths + 1 + context).sum())
    min_bytes = kv_positions * n_kv * head_dim * 2 * 2 + 2 * q.numel() * 2  # K, V once; q in, out
    return {
        "kernel": "varlen_attention", "R": r, "gamma": gamma, "context": context, "N": int(cu[-1]),
        "heads": n_heads, "kv_heads": n_kv, "head_dim": head_dim, "dtype": "bf16",
        "matches_reference": bool(torch.allclose(ref.float(), got.float(), atol=2e-2, rtol=2e-2)),
        "max_abs_err": float((ref.float() - got.float()).abs().max()),
        "triton_ms": timed(lambda: varlen_attention_triton(*args, max_new_tokens=max_new), rep_ms),
        "torch_ms": timed(lambda: varlen_attention_ref(*args), rep_ms),
        "min_bytes": min_bytes,
    }


def bench_block_sample(r: int, gamma: int, rep_ms: int, filtered: bool, rank: int = 256) -> dict:
    from dspark_kernels.block_sample import block_sample_triton
    from dspark_kernels.reference import block_sample_ref

    dev = "cuda"
    base = torch.randn(r, gamma, VOCAB, device=dev, dtype=torch.bfloat16) * 3
    w1 = torch.randn(VOCAB, rank, device=dev, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(VOCAB, rank, device=dev, dtype=torch.bfloat16) * 0.05
    anchors = torch.randint(0, VOCAB, (r,), device=dev)
    t = torch.full((r,), 0.7, device=dev)
    k = torch.full((r,), 20 if filtered else 0, device=dev, dtype=torch.int64)
    p = torch.full((r,), 0.8 if filtered else 1.0, device=dev)
    u = torch.rand(r, gamma, device=dev)
    args = (base, anchors, w1, w2, t, k, p, u)
    (ref_tok, ref_p), (tok, probs) = block_sample_ref(*args), block_sample_triton(*args)
    # Must move: U (bf16) once, W2 once per position, W1 rows, p_d written once (f32).
    min_bytes = base.numel() * 2 + gamma * w2.numel() * 2 + r * gamma * VOCAB * 4
    return {
        "kernel": "block_sample", "R": r, "gamma": gamma, "V": VOCAB, "rank": rank,
        "sampling": "T0.7,top_k20,top_p0.8" if filtered else "T0.7",
        "matches_reference": bool(torch.equal(tok, ref_tok)),
        "token_agreement": float((tok == ref_tok).float().mean()),
        "max_abs_prob_err": float((probs - ref_p).abs().max()),
        "triton_ms": timed(lambda: block_sample_triton(*args), rep_ms),
        "torch_ms": timed(lambda: block_sample_ref(*args), rep_ms),
        "min_bytes": min_bytes,
    }


def gpu_slug() -> str:
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="R in (1, 256), γ = 16 only")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per case")
    p.add_argument("--out", default=None, help="default: results/kernels_<gpu>.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels/bench.py times Triton kernels on a CUDA GPU and none is available here; "
              "run it on a GPU machine (the CPU tests use TRITON_INTERPRET=1 instead).", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    requests, gammas = ((1, 256), (16,)) if args.quick else (REQUESTS, GAMMAS)
    cases = []
    for r in requests:
        for gamma in gammas:
            cases.append(lambda r=r, gamma=gamma: bench_rejection(r, gamma, args.rep_ms))
            cases.append(lambda r=r, gamma=gamma: bench_attention(r, gamma, args.rep_ms))
            cases.append(lambda r=r, gamma=gamma: bench_block_sample(r, gamma, args.rep_ms, filtered=False))
            if r <= 32:  # top-k/top-p bisection: 64 passes per row and position
                cases.append(lambda r=r, gamma=gamma: bench_block_sample(r, gamma, args.rep_ms, True))
    rows = []
    for case in cases:
        t0 = time.time()
        try:
            row = case()
        except Exception as e:  # keep measuring the others; the error is part of the report
            row = {"error": f"{type(e).__name__}: {e}"}
        else:
            for impl in ("triton", "torch"):
                row[f"{impl}_GBps"] = row["min_bytes"] / (row[f"{impl}_ms"] * 1e-3) / 1e9
            row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["wall_s"] = time.time() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    import triton

    default_out = Path(__file__).resolve().parents[1] / "results" / f"kernels_{gpu_slug()}.json"
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
        "note": "GBps = min_bytes / median time: the bytes the op must move (inputs read once, outputs once)",
        "results": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
