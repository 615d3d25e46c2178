"""Interpolated Kneser-Ney 3-gram model over token ids: the baseline the demo target must
beat on held-out perplexity (results/target_eval.json).

With absolute discount D_n = n1 / (n1 + 2 n2) per order (n1, n2: how many n-grams of that
order occur once / twice, counted the way that order counts):
    P3(w|u,v) = max(c(uvw) - D3, 0) / c(uv.) + D3 N1+(uv.) / c(uv.) * P2(w|v)    (P2 if c(uv.) = 0)
    P2(w|v)   = max(N1+(.vw) - D2, 0) / N1+(.v.) + D2 N1+(v.)' / N1+(.v.) * P1(w)  (P1 if N1+(.v.) = 0)
    P1(w)     = max(N1+(.w) - D1, 0) / N1+(..) + D1 |{w: N1+(.w) > 0}| / N1+(..) / V
where N1+(.vw) counts distinct left contexts u of the bigram vw (continuation counts),
N1+(v.)' counts distinct w with N1+(.vw) > 0. Counting is vectorised with numpy over
int64 n-gram keys (u V^2 + v V + w), lookups with searchsorted.
"""

from __future__ import annotations

import numpy as np


def _discount(counts: np.ndarray) -> float:
    n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
    return n1 / (n1 + 2 * n2) if n1 + n2 > 0 else 0.5


def _group_sum(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (unique keys, sum of values per key, number of entries per key)."""
    uniq, inv, n = np.unique(keys, return_inverse=True, return_counts=True)
    return uniq, np.bincount(inv, weights=values).astype(np.float64), n.astype(np.float64)


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """values[key == query], or 0 where the query key is absent (keys sorted)."""
    idx = np.searchsorted(keys, query).clip(0, max(0, keys.size - 1))
    hit = keys[idx] == query if keys.size else np.zeros(query.shape, bool)
    return np.where(hit, values[idx] if keys.size else 0.0, 0.0)


class KneserNeyTrigram:
    def __init__(self, tokens: np.ndarray, vocab_size: int) -> None:
        t = tokens.astype(np.int64)
        V = self.V = int(vocab_size)
        # order 3: raw counts c(uvw), context totals c(uv.), distinct followers N1+(uv.)
        self.tri_keys, tri_counts = np.unique(t[:-2] * V * V + t[1:-1] * V + t[2:], return_counts=True)
        self.tri_counts = tri_counts.astype(np.float64)
        self.d3 = _discount(tri_counts)
        self.ctx3_keys, self.ctx3_total, self.ctx3_types = _group_sum(self.tri_keys // V, self.tri_counts)
        # order 2: continuation counts N1+(.vw) = distinct u per (v, w)
        self.bi_keys, bi_cont = np.unique(self.tri_keys % (V * V), return_counts=True)
        self.bi_cont = bi_cont.astype(np.float64)
        self.d2 = _discount(bi_cont)
        self.ctx2_keys, self.ctx2_total, self.ctx2_types = _group_sum(self.bi_keys // V, self.bi_cont)
        # order 1: N1+(.w) = distinct v per w over all bigrams of the stream
        uni_pairs = np.unique(t[:-1] * V + t[1:])
        uni_cont = np.bincount(uni_pairs % V, minlength=V).astype(np.float64)
        self.d1 = _discount(uni_cont[uni_cont > 0])
        total = uni_cont.sum()
        seen = float((uni_cont > 0).sum())
        self.p1 = np.maximum(uni_cont - self.d1, 0) / total + self.d1 * seen / total / V

    def prob(self, u: np.ndarray, v: np.ndarray, w: np.ndarray) -> np.ndarray:
        """P(w | u, v) for aligned int arrays (vectorised)."""
        V = self.V
        u, v, w = (np.asarray(a, dtype=np.int64) for a in (u, v, w))
        p = self.p1[w]
        n2 = _lookup(self.ctx2_keys, self.ctx2_total, v)
        t2 = _lookup(self.ctx2_keys, self.ctx2_types, v)
        c2 = _lookup(self.bi_keys, self.bi_cont, v * V + w)
        safe2 = np.maximum(n2, 1.0)
        p = np.where(n2 > 0, np.maximum(c2 - self.d2, 0) / safe2 + self.d2 * t2 / safe2 * p, p)
        n3 = _lookup(self.ctx3_keys, self.ctx3_total, u * V + v)
        t3 = _lookup(self.ctx3_keys, self.ctx3_types, u * V + v)
        c3 = _lookup(self.tri_keys, self.tri_counts, (u * V + v) * V + w)
        safe3 = np.maximum(n3, 1.0)
        return np.where(n3 > 0, np.maximum(c3 - self.d3, 0) / safe3 + self.d3 * t3 / safe3 * p, p)

    def token_nll(self, tokens: np.ndarray, start: int = 2) -> np.ndarray:
        """-log P(tokens[i] | tokens[i-2], tokens[i-1]) for i in [start, len)."""
        t = tokens.astype(np.int64)
        i = np.arange(start, t.size)
        return -np.log(self.prob(t[i - 2], t[i - 1], t[i]))
