"""Per-request sampling parameters and the one function that turns logits into the
distribution a token is drawn from. Draft, target, verification and plain decoding all
call `sampling_probs`, so temperature / top-k / top-p are applied identically everywhere
(docs/architecture.md §5, §6: lossless verification needs p_d and p_t filtered the same way)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """Per-request Philox-style generator: a seeded request is reproducible."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(int(self.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return g


def param_tensors(params: list[SamplingParams], device: str | torch.device = "cpu"):
    """Per-row tensors (temperature [R] f32, top_k [R] i64, top_p [R] f32) for `sampling_probs`."""
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    pp = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    return t, k, pp


def sampling_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] f32, 0 = greedy
    top_k: torch.Tensor,  # [N] i64, 0 = off
    top_p: torch.Tensor,  # [N] f32, 1 = off
) -> torch.Tensor:  # [N, V] f32, rows sum to 1
    """The distribution each row samples from: temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches top_p), renormalised.
    Greedy rows are one-hot on the argmax (ties: lowest token id)."""
    n, v = logits.shape
    x = logits.float()
    greedy = temperature <= 0
    onehot = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    if bool(greedy.all()):
        return onehot
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(x / t[:, None], dim=-1)
    filtered = (((top_k > 0) & (top_k < v)) | (top_p < 1.0)) & ~greedy
    if bool(filtered.any()):  # the sort is the costly part: only rows with top-k/top-p pay it
        rows = filtered.nonzero().squeeze(-1)
        probs[rows] = _top_k_top_p(x[rows] / t[rows, None], top_k[rows], top_p[rows])
    return torch.where(greedy[:, None], onehot, probs)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """softmax restricted to the top-k, then to the smallest top set whose mass reaches top_p."""
    v = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    keep = rank[None, :] < k[:, None]
    p_sorted = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = p_sorted.cumsum(-1) - p_sorted
    keep &= mass_before < top_p[:, None]
    p_sorted = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.zeros_like(x).scatter_(-1, order, p_sorted)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [R, V] using each row's own generator -> [R] i64."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for i, g in enumerate(generators):
        out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return out
