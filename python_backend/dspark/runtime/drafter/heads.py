"""Sequential heads and the confidence head of the DSpark drafter (docs/architecture.md §5).

The parallel backbone gives base logits U_k for every block position at once; a sequential
head adds a bias B_k(x_{k-1}, ·) so the block is sampled left to right and stays coherent:
    p_k = sampling_probs(U_k + B_k(x_{k-1}))
Heads expose one call per block position (`step`, used when sampling) and a teacher-forced
call over a whole block (`teacher`, used in training: x_{k-1} is the true token). Both return
rank-r features F_k; `bias(F_k) = W2 F_k` is the [V] logit bias, applied after the caller
has kept only the rows it needs (the V-wide product dominates the cost).

The confidence head c_k = σ(wᵀ[h_k; W1[x_{k-1}]] + b) reads the backbone output h_k and the
previous token only, so it never depends on x_k (docs/architecture.md §6, non-anticipation)."""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """B_k(x, ·) = W1[x] W2: a rank-r bigram correction shared by all positions."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.W1 = nn.Embedding(vocab_size, rank)
        self.W2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.W1.weight, std=0.02)
        nn.init.zeros_(self.W2.weight)  # starts as the DFlash baseline (B = 0)

    def step(self, x_prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """x_prev [R] i64, h [R, d] -> (F_k [R, r], state)."""
        return self.W1(x_prev), state

    def teacher(self, x_prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x_prev [..., K] i64, h [..., K, d] -> F [..., K, r]."""
        return self.W1(x_prev)

    def bias(self, feats: torch.Tensor) -> torch.Tensor:
        return self.W2(feats)

    def token_features(self, x_prev: torch.Tensor) -> torch.Tensor:
        return self.W1(x_prev)


class RNNHead(nn.Module):
    """z_k = [s_{k-1}; W1[x_{k-1}]; h_k] -> Linear(2r+d, 3r) -> g, c, o;
    s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c), s_0 = 0; B_k = W2 tanh(o)   (docs/architecture.md §5)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.W1 = nn.Embedding(vocab_size, rank)
        self.gates = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.W2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.W1.weight, std=0.02)
        nn.init.zeros_(self.W2.weight)

    def step(self, x_prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        s_prev = h.new_zeros(h.shape[:-1] + (self.rank,)) if state is None else state
        g, c, o = self.gates(torch.cat([s_prev, self.W1(x_prev), h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        s = gate * s_prev + (1 - gate) * torch.tanh(c)
        return torch.tanh(o), s

    def teacher(self, x_prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        state, out = None, []
        for k in range(x_prev.shape[-1]):
            b, state = self.step(x_prev[..., k], h[..., k, :], state)
            out.append(b)
        return torch.stack(out, dim=-2)

    def bias(self, feats: torch.Tensor) -> torch.Tensor:
        return self.W2(feats)

    def token_features(self, x_prev: torch.Tensor) -> torch.Tensor:
        return self.W1(x_prev)


class NoHead(nn.Module):
    """The DFlash baseline: independent positions, B = 0. Its confidence head still needs the
    previous token, so it owns a small embedding of x_{k-1} (used by the confidence head only)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.W1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.W1.weight, std=0.02)

    def step(self, x_prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        return None, state

    def teacher(self, x_prev: torch.Tensor, h: torch.Tensor) -> None:
        return None

    def bias(self, feats: None) -> None:
        return None

    def token_features(self, x_prev: torch.Tensor) -> torch.Tensor:
        return self.W1(x_prev)


HEADS = {"markov": MarkovHead, "rnn": RNNHead, "none": NoHead}


class ConfidenceHead(nn.Module):
    """z_k = wᵀ[h_k; W1[x_{k-1}]] + b (a logit; STS turns it into ĉ_k = σ(z_k / T_k))."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.constant_(self.proj.bias, 0.0)

    def forward(self, h: torch.Tensor, token_features: torch.Tensor, apply=None) -> torch.Tensor:
        """h [..., d], token_features [..., r] -> z [...]. apply(linear, x): how to run the
        projection (default: the module itself; serving passes its packed weights)."""
        x = torch.cat([h, token_features], dim=-1)
        return (self.proj(x) if apply is None else apply(self.proj, x)).squeeze(-1)


def make_head(kind: str, vocab_size: int, hidden_size: int, rank: int) -> nn.Module:
    if kind not in HEADS:
        raise ValueError(f"unknown sequential head {kind!r}; choose from {', '.join(HEADS)}")
    return HEADS[kind](vocab_size, hidden_size, rank)
