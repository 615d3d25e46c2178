"""Per-request sampling parameters, the one function that turns logits into the distribution a
token is drawn from, and per-request randomness.

Draft, target, verification and plain decoding all call `sampling_probs`, so temperature /
top-k / top-p are applied identically everywhere (architecture §5, §6: lossless verification
needs p_d and p_t filtered the same way).

Randomness is counter-based (Philox-4x32-10, vectorised over requests): the uniforms of request
r at engine step s are a pure function of (r's key, s, stream), so a request with a `seed` is
reproducible, nothing loops over requests, and the same numbers come out on any device."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from dspark_kernels.reference import sample_inverse_cdf, top_k_top_p

__all__ = ["SamplingBatch", "SamplingParams", "param_tensors", "philox_uniforms", "sample_inverse_cdf",
           "sampling_probs"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean off; seed None means unseeded."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Sampled with top-k or top-p (the rows that pay for a sort)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def rng_key(self) -> int:
        """The request's 63-bit Philox key: from the seed, or fresh OS entropy when unseeded."""
        if self.seed is None:
            return secrets.randbits(63)
        return int(self.seed) & 0x7FFF_FFFF_FFFF_FFFF


def param_tensors(params: list[SamplingParams], device: str | torch.device = "cpu"):
    """Per-row tensors (temperature [R] f32, top_k [R] i64, top_p [R] f32) for `sampling_probs`."""
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    pp = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    return t, k, pp


@dataclass
class SamplingBatch:
    """The parameters of R rows as device tensors, plus host masks so that choosing a code path
    (all greedy? which rows need a sort?) never waits on the device."""

    temperature: torch.Tensor  # [R] f32 (device), 0 = greedy
    top_k: torch.Tensor  # [R] i64 (device), 0 = off
    top_p: torch.Tensor  # [R] f32 (device), 1 = off
    greedy: torch.Tensor  # [R] bool (host)
    filtered: torch.Tensor  # [R] bool (host): top-k or top-p on a sampled row
    _sub: tuple[torch.Tensor, SamplingBatch] | None = field(default=None, repr=False)  # sampled rows

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: str | torch.device = "cpu") -> SamplingBatch:
        t, k, p = param_tensors(params, device)
        return cls(t, k, p, torch.tensor([q.greedy for q in params], dtype=torch.bool),
                   torch.tensor([q.filtered for q in params], dtype=torch.bool))

    def __len__(self) -> int:
        return int(self.greedy.numel())

    def select(self, rows: torch.Tensor) -> SamplingBatch:
        """The rows `rows` [M] i64 (host), in that order."""
        dev = rows.to(self.temperature.device)
        return SamplingBatch(self.temperature[dev], self.top_k[dev], self.top_p[dev], self.greedy[rows],
                             self.filtered[rows])

    def repeat(self, counts: torch.Tensor) -> SamplingBatch:
        """Row r repeated counts[r] times (host [R] i64), e.g. once per verified token."""
        dev = counts.to(self.temperature.device)
        rep = lambda x, c: x.repeat_interleave(c, output_size=int(counts.sum()))
        return SamplingBatch(rep(self.temperature, dev), rep(self.top_k, dev), rep(self.top_p, dev),
                             rep(self.greedy, counts), rep(self.filtered, counts))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """sampling_probs of logits [R, V] with these rows' parameters, without a host sync."""
        return _probs(logits, self.temperature, self.top_k, self.top_p, self.greedy, self.filtered)

    def draw(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of logits [R, V]: greedy rows take the argmax, sampled rows draw by
        inverse CDF with uniforms [R]. -> (tokens [R] i64, the distributions of the sampled rows
        [R_s, V] f32 in row order, or None when every row is greedy)."""
        sampled = (~self.greedy).nonzero().squeeze(-1)
        if sampled.numel() == 0:
            return logits.max(-1).indices, None  # first maximum, like argmax (faster on CPU)
        if sampled.numel() == len(self):
            probs = self.probs(logits)
            return sample_inverse_cdf(probs, uniforms), probs
        tokens = logits.max(-1).indices
        if self._sub is None:
            self._sub = (sampled.to(logits.device), self.select(sampled))
        idx, sub = self._sub
        probs = sub.probs(logits[idx])
        tokens[idx] = sample_inverse_cdf(probs, uniforms[idx])
        return tokens, probs


def sampling_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] f32, 0 = greedy
    top_k: torch.Tensor,  # [N] i64, 0 = off
    top_p: torch.Tensor,  # [N] f32, 1 = off
) -> torch.Tensor:  # [N, V] f32, rows sum to 1
    """The distribution each row samples from: temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches top_p), renormalised.
    Greedy rows are one-hot on the argmax (ties: lowest token id)."""
    v = logits.shape[-1]
    greedy = (temperature <= 0).cpu()
    filtered = ((((top_k > 0) & (top_k < v)) | (top_p < 1.0)).cpu()) & ~greedy
    return _probs(logits, temperature, top_k, top_p, greedy, filtered)


def _probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           greedy: torch.Tensor, filtered: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    dev = x.device
    if bool(greedy.all()):
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    probs = torch.softmax(x / t[:, None], dim=-1)
    if bool(filtered.any()):  # the sort is the costly part: only rows with top-k/top-p pay it
        rows = filtered.nonzero().squeeze(-1).to(dev)
        probs[rows] = top_k_top_p(x[rows] / t[rows, None], top_k[rows], top_p[rows])
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(-1).to(dev)
        probs[rows] = torch.zeros_like(probs[rows]).scatter_(-1, x[rows].argmax(-1, keepdim=True), 1.0)
    return probs


# ---- counter-based randomness ------------------------------------------------------------------

# Streams: which use of a step's randomness (a request's draws never collide across uses).
STREAM_DRAFT, STREAM_VERIFY, STREAM_FIRST = 0, 1, 2
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a · m for a, m < 2^32 held in int64, without overflow."""
    lo_part = (a & 0xFFFF) * m  # < 2^48
    t = (a >> 16) * m + (lo_part >> 16)  # < 2^49
    return t >> 16, ((t & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               rounds: int = 10) -> list[torch.Tensor]:
    """Philox-4x32 (Salmon et al. 2011) on int64 tensors holding uint32 words -> 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mul_hi_lo(c0, _M0)
        hi1, lo1 = _mul_hi_lo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return [c0, c1, c2, c3]


def philox_uniforms(keys: torch.Tensor, counters: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """[R, width] f32 in [0, 1): row r is a pure function of (keys[r], counters[r], stream).
    keys, counters: [R] i64 (>= 0) on the device the uniforms are wanted on."""
    r = keys.shape[0]
    blocks = (width + 3) // 4
    dev = keys.device
    shape = (r, blocks)
    k = keys[:, None].expand(shape)
    c = counters[:, None].expand(shape)
    words = philox4x32((c & _MASK32, c >> 32, torch.full(shape, stream, dtype=torch.int64, device=dev),
                        torch.arange(blocks, device=dev).expand(shape)), (k & _MASK32, k >> 32))
    bits = torch.stack(words, dim=-1).reshape(r, blocks * 4)[:, :width]
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))
