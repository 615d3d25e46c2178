"""Steps-per-second table: how fast one engine step runs at token batch size B (docs/architecture.md §7).

`sps.json` holds `device`, `model`, `batch_tokens` (ascending profiled sizes),
`steps_per_second` (one per size) and `padded`. A padded table (a GPU engine with CUDA-graph
buckets) is read at the NEXT profiled bucket >= B: a step of 37 tokens is padded to the
48-token graph and costs what 48 costs, so the table is jagged on purpose and the scheduler
sees the cliffs. An unpadded one (an eager CPU engine runs exactly B tokens) interpolates step
time linearly between profiled sizes: reading it jagged would invent cliffs between the sizes
that were profiled (B = 5 priced as 6) and stop speculation there for nothing. Tables without
the field are unpadded when their device is a CPU ("cpu..."), padded otherwise.

Beyond the largest profiled size we extrapolate LINEARLY IN STEP TIME (1/SPS) with the
slope of the last two buckets (never below zero slope): past the knee a step is
compute-bound and its time grows ~linearly in tokens, so clamping would wrongly make
extra tokens free. Below the smallest size the smallest bucket is used.

An optional `ragged` grid prices a step by request count too: `{"requests": [R..],
"tokens_per_request": [t..], "seconds": [[step seconds at (R_i, t_j)]]}`. On a CPU engine the
cost of B tokens depends on how many sequences hold them (each reads its own K/V, and a
64-token step of 32 requests costs ~1.5x one of 16), which a table by B alone prices at one
fixed split. `rates_for(R)` reads the grid at R (linear in step time between profiled R and
tokens per request, linear extrapolation past the largest of each); without a grid it is the
table by B. Each R's curve over t >= 2 tokens per request is read CONVEX (`smooth_by_tokens`):
one profiled cell is measured over a few steps on a shared CPU and is off by a few ms, and read
raw those errors are fake cheap segments (R = 32: the 4th token per request priced at a third of
the 3rd) that Θ's argmax jumps across, admitting tokens that do not pay. The table file keeps
the raw measurements.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

# GPU-shaped synthetic table (see `SPSTable.gpu_shaped`). An 8B bf16 model on one
# H100-class GPU: a decode step reads ~16 GB of weights at ~3.3 TB/s (~5 ms, memory-bound,
# flat in B) plus ~1 ms of launch/sampling overhead; each token costs ~2·8e9 FLOP, i.e.
# ~25 µs at ~650 TFLOP/s effective, so compute overtakes the weight read at B ≈ 200
# (the knee). Buckets are the usual CUDA-graph capture sizes.
GPU_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768,
               1024, 1536, 2048, 3072, 4096]
GPU_OVERHEAD_MS = 1.0
GPU_WEIGHT_READ_MS = 5.0
GPU_MS_PER_TOKEN = 0.025


@dataclass
class SPSTable:
    batch_tokens: list[int]
    steps_per_second: list[float]
    device: str = "unknown"
    model: str = "unknown"
    padded: bool | None = None  # steps run at the next profiled size (None: not on a CPU)
    ragged: dict | None = None  # optional (R, tokens per request) grid of step seconds (see above)

    def __post_init__(self) -> None:
        if len(self.batch_tokens) != len(self.steps_per_second) or not self.batch_tokens:
            raise ValueError("batch_tokens and steps_per_second must be non-empty and the same length")
        order = sorted(range(len(self.batch_tokens)), key=lambda i: self.batch_tokens[i])
        self.batch_tokens = [int(self.batch_tokens[i]) for i in order]
        self.steps_per_second = [float(self.steps_per_second[i]) for i in order]
        if any(b < 1 for b in self.batch_tokens) or any(s <= 0 for s in self.steps_per_second):
            raise ValueError("batch sizes must be >= 1 and steps/second > 0")
        if len(set(self.batch_tokens)) != len(self.batch_tokens):
            raise ValueError("batch_tokens must be distinct")
        if self.padded is None:
            self.padded = not str(self.device).lower().startswith("cpu")
        self._buckets = torch.tensor(self.batch_tokens, dtype=torch.int64)
        self._sps = torch.tensor(self.steps_per_second, dtype=torch.float64)
        step_time = 1.0 / self._sps
        slope = 0.0
        if len(self.batch_tokens) >= 2:
            slope = float((step_time[-1] - step_time[-2]) / (self._buckets[-1] - self._buckets[-2]))
        self._tail_slope = max(slope, 0.0)  # seconds per extra token beyond the largest bucket
        if self.ragged is not None:
            self._check_ragged(self.ragged)

    @staticmethod
    def _check_ragged(grid: dict) -> None:
        requests, tpr, seconds = grid.get("requests"), grid.get("tokens_per_request"), grid.get("seconds")
        if not requests or not tpr or seconds is None:
            raise ValueError("ragged grid needs requests, tokens_per_request and seconds")
        if sorted(set(requests)) != list(requests) or sorted(set(tpr)) != list(tpr) or min(requests) < 1 \
                or min(tpr) < 1:
            raise ValueError("ragged requests and tokens_per_request must be ascending, distinct and >= 1")
        if np.shape(seconds) != (len(requests), len(tpr)) or not np.all(np.asarray(seconds) > 0):
            raise ValueError("ragged seconds must be [len(requests)][len(tokens_per_request)], all > 0")

    def lookup(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """Vectorised SPS for int tensor B (any shape) -> f64 tensor of the same shape."""
        b = torch.as_tensor(batch_tokens, dtype=torch.int64)
        idx = torch.searchsorted(self._buckets, b, right=False)  # first bucket >= B
        inside = idx < len(self.batch_tokens)
        hi = idx.clamp(max=len(self.batch_tokens) - 1)
        sps = self._sps[hi]
        if not self.padded:  # step time linear between the profiled sizes around B
            lo = (hi - 1).clamp(min=0)
            b_lo, b_hi = self._buckets[lo].to(torch.float64), self._buckets[hi].to(torch.float64)
            w = ((b.to(torch.float64) - b_lo) / (b_hi - b_lo).clamp(min=1.0)).clamp(0.0, 1.0)
            sps = 1.0 / ((1.0 - w) / self._sps[lo] + w / self._sps[hi])
        extra = (b - self._buckets[-1]).clamp(min=0).to(torch.float64)
        tail = 1.0 / (1.0 / self._sps[-1] + extra * self._tail_slope)
        return torch.where(inside, sps, tail)

    def rates_for(self, num_requests: int, max_batch_tokens: int) -> np.ndarray:
        """Steps/second of a step of R requests by B = 0..max_batch_tokens tokens [f64]: the ragged
        grid at R where there is one (B < R reads B = R), else the table by B."""
        if self.ragged is None:
            return self.lookup(torch.arange(max_batch_tokens + 1)).numpy().astype(np.float64)
        r = max(int(num_requests), 1)
        grid_r = np.asarray(self.ragged["requests"], dtype=np.float64)
        tpr = np.asarray(self.ragged["tokens_per_request"], dtype=np.float64)
        seconds = np.asarray(self.ragged["seconds"], dtype=np.float64)  # [R grid, tpr grid]
        by_tpr = smooth_by_tokens(tpr, np.array([_linear(r, grid_r, seconds[:, j]) for j in range(len(tpr))]))
        per_request = np.maximum(np.arange(max_batch_tokens + 1, dtype=np.float64), r) / r
        return 1.0 / _linear(per_request, tpr, by_tpr)

    def __call__(self, batch_tokens: int) -> float:
        return float(self.lookup(torch.tensor([int(batch_tokens)]))[0])

    def step_time(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds per step at B (vectorised)."""
        return 1.0 / self.lookup(batch_tokens)

    @classmethod
    def gpu_shaped(cls) -> SPSTable:
        """Synthetic H100-class table: flat to the knee (B ≈ 200), then linear in B (see constants)."""
        ms = [GPU_OVERHEAD_MS + max(GPU_WEIGHT_READ_MS, GPU_MS_PER_TOKEN * b) for b in GPU_BUCKETS]
        return cls(list(GPU_BUCKETS), [1000.0 / t for t in ms], device="synthetic-gpu-shaped",
                   model="8B-class (memory-bound 6 ms to B~200, then +25 us/token)")

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["ragged"] is None:
            del d["ragged"]  # tables without a grid keep their older shape
        return d

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SPSTable:
        d = json.loads(Path(path).read_text())
        return cls(d["batch_tokens"], d["steps_per_second"], d.get("device", "unknown"),
                   d.get("model", "unknown"), d.get("padded"), d.get("ragged"))


# how far `smooth_by_tokens` may price a profiled cell under its measurement: a cell is
# measured over a few steps on a shared CPU, off by a few ms (up to ~10 % of a step)
SMOOTH_MAX_CUT = 0.10


def smooth_by_tokens(tokens: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Step seconds of one R by tokens per request, made convex over t >= 2 where the profile is
    within noise of convex: the slopes between neighbouring cells are pooled where they fall
    (pool-adjacent-violators, weighted by the gap in t, clipped at >= 0) from the t = 2 cell as
    measured, no cell is priced more than SMOOTH_MAX_CUT under its measurement, and the curve
    never falls nor goes below the t = 1 step, which stays measured (a plain step is its own
    regime: no draft rows). A cell measured slow then no longer makes the next segment a fake
    cheap one, while a cost that bends upwards is read as it bends and a real downward bend
    (int4 layers switching to dense weights at `quant.DENSE_FROM_ROWS` rows) is not flattened
    away. A least-squares line did the first but not the second: at 32 requests its intercept
    priced t = 2 at 81 ms against 101 measured, the mtp1-sized budget that pays at high load."""
    rest = tokens >= 2
    if int(rest.sum()) < 3:
        return seconds
    out = np.array(seconds, dtype=np.float64)
    x, y = np.asarray(tokens, dtype=np.float64)[rest], out[rest]
    widths = np.diff(x)
    blocks: list[list[float]] = []  # [pooled slope, total width, segments pooled]
    for slope, w in zip(np.diff(y) / widths, widths):
        blocks.append([float(slope), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            s2, w2, n2 = blocks.pop()
            s1, w1, n1 = blocks.pop()
            blocks.append([(s1 * w1 + s2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    slopes = np.repeat([max(b[0], 0.0) for b in blocks], [int(b[2]) for b in blocks])
    convex = y[0] + np.concatenate([[0.0], np.cumsum(slopes * widths)])
    floor = out[~rest].max() if (~rest).any() else 0.0  # the t = 1 step
    out[rest] = np.maximum.accumulate(np.maximum(np.maximum(convex, (1.0 - SMOOTH_MAX_CUT) * y), floor))
    return out


def _linear(x, xs: np.ndarray, ys: np.ndarray):
    """Piecewise-linear y(x) through (xs, ys): the first value below xs, past the last point the
    last segment's slope (never falling: a cost measured to grow is not assumed to shrink)."""
    y = np.interp(x, xs, ys)
    if len(xs) < 2:
        return y
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return np.where(np.asarray(x) > xs[-1], ys[-1] + slope * (np.asarray(x) - xs[-1]), y)


def solve3(m: list[list[float]], y: list[float]) -> list[float]:
    """x with m x = y for a 3x3 m (Gaussian elimination with partial pivoting, in Python floats;
    a singular m gives x = 0 where it cannot tell)."""
    rows = [list(m[i]) + [y[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0.0:
            continue
        for r in range(col + 1, 3):
            f = rows[r][col] / rows[col][col]
            for k in range(col, 4):
                rows[r][k] -= f * rows[col][k]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        if rows[i][i] != 0.0:
            x[i] = (rows[i][3] - sum(rows[i][k] * x[k] for k in range(i + 1, 3))) / rows[i][i]
    return x


class _ByRequests:
    """Seconds by request count R: a moving average per measured R, robust to one-off spikes;
    unmeasured R interpolate linearly between the nearest measured ones; beyond them constant, or
    with `extrapolate` above the largest measured R linearly on the slope of the two largest (never
    falling: a cost that grows with R, like propose, is not assumed flat where nobody measured it).

    One-off costs only ever add time (the first step at a new batch shape builds its matmul
    primitives, a JIT compiles): the first `WARM_STEPS` observations at an R count by their
    minimum, and after them an observation above the average counts at most `spike_room` above it
    (4 mean absolute deviations, at least 10 % + 1 ms). Unclipped, one 30 ms first step at R = 16
    made drafting look slower than plain decoding there for a hundred steps."""

    WARM_STEPS = 3

    def __init__(self, seconds: dict[int, float] | None, alpha: float, extrapolate: bool = False) -> None:
        self.alpha, self.extrapolate = alpha, extrapolate
        self.by_r: dict[int, float] = {int(r): float(s) for r, s in (seconds or {}).items()}
        # R -> [observations, mean absolute deviation]; given costs count as past the warm steps
        self._seen: dict[int, list[float]] = {r: [self.WARM_STEPS, 0.0] for r in self.by_r}

    def spike_room(self, num_requests: int) -> float:
        value, deviation = self.by_r[num_requests], self._seen[num_requests][1]
        return max(4.0 * deviation, 0.1 * abs(value) + 1e-3)

    def observe(self, num_requests: int, seconds: float) -> None:
        old = self.by_r.get(num_requests)
        seen = self._seen.setdefault(num_requests, [0, 0.0])
        seen[0] += 1
        if old is None:
            self.by_r[num_requests] = seconds
        elif seen[0] <= self.WARM_STEPS:
            self.by_r[num_requests] = min(old, seconds)
        else:  # the deviation learns from the clipped value: a spike cannot widen its own room
            clipped = min(seconds, old + self.spike_room(num_requests))
            seen[1] += self.alpha * (abs(clipped - old) - seen[1])
            self.by_r[num_requests] = old + self.alpha * (clipped - old)

    def __call__(self, num_requests: int) -> float | None:
        if not self.by_r:
            return None
        if num_requests in self.by_r:
            return self.by_r[num_requests]
        rs = sorted(self.by_r)
        xs, ys = np.asarray(rs, dtype=np.float64), np.asarray([self.by_r[r] for r in rs])
        if self.extrapolate:
            return float(_linear(num_requests, xs, ys))
        return float(np.interp(num_requests, xs, ys))  # constant beyond the measured range


class DraftCost:
    """What a step costs beyond the target forward the SPS table prices (architecture §7, drafting
    cost), by request count R, learned online by the engine or given up front:
    - `t_draft(R)` (calling the object): seconds of drafter.propose;
    - `verify_scale(R)` = (a, b, c): a drafted step's target forward ≈ a·base + b·rows +
      c·beyond, with base = 1/SPS(R) the table's price of the R anchor rows, rows =
      1/SPS(min(B, 2R)) − 1/SPS(R) that of the first R draft rows (one per request) and beyond =
      1/SPS(B) − 1/SPS(min(B, 2R)) that of the rest. Live ragged budgets are priced by grid
      cells that mix lengths one fixed way; where they cost more, b or c > a and the price of
      every draft token rises with it, so budgets shrink until what they cost and what they are
      priced at agree (an additive overhead fed back the other way: learned at a large budget it
      made every token look relatively cheaper, and budgets grew). Apart beyond R rows: on a CPU
      without AMX a row past the first R cost ~4 ms at 8 requests against ~2 ms for the first R
      (compute-bound matmuls), and one scale fitted mostly on one-per-request steps priced large
      budgets at half what they took;
    - `overhead(R, drafted)`: the rest of a whole step's wall time, measured minus propose minus
      the modelled forward (a·base + b·rows + c·beyond drafted, 1/SPS(R) plain): acceptance, the drafter's
      extend, host work and, behind Triton, the hops to the `target` and `drafter` models. Kept
      apart for steps that call the drafter and for plain steps, so the rule compares whole
      drafted steps with whole plain steps (`plain_step`: a plain step priced at most as a
      drafted one without draft rows);
    - what steps delivered (`observe_rate`: tokens and wall time of whole steps, per R and mode):
      `plain_rate(R)`, the measured plain tokens/second, `nearest_uniform(R)`, that of drafted
      steps of the uniform shape at R or the nearest R of its class (one draft per request,
      `DSpark.wants_draft`), and
      `speculative_correction(R)`, the ratio of the measured rate of ranked speculative steps
      to what the rule's model predicted for those steps (`observe_prediction`), each once it
      has `RATE_MIN_STEPS` steps at R. A measured plain rate goes stale while the rule keeps
      drafting (no plain step refreshes it): after `PLAIN_STALE_STEPS` steps without a plain
      step at R (`plain_stale`), the next one's rate replaces the average instead of joining it
      (`DSpark.wants_draft` runs such a plain probe where speculation's lead is small).
    - paired readings (`paired_ratio`): a moving average is measured in its own stretch of a
      closed loop, and plain decoding's steps at 32 requests delivered 0.84x to 1.24x of their
      mean over one loop (rolling 8 steps, `dspark bench-rule`), so two averages measured in
      different stretches (a drafting mode's while the rule skipped, and plain's now) differ by
      more than the modes do. A step whose mode differs from the run of steps at R before it
      gives one paired reading: its rate over that run's (its last PAIR_RUN steps, at least
      PAIR_RUN_MIN), both measured in the same stretch; their logarithms are averaged per class
      of R and pair of modes ("plain", "uniform", "ranked")."""

    RATE_ALPHA = 0.2  # weight of the newest step in the measured rates (~ the last 10 steps)
    RATE_MIN_STEPS = 4  # steps at R before a measured rate or correction is used
    # the correction is clipped: it removes the model's bias (a few per cent, up to ~1.5x in a
    # burst's tail), not its response to the survivals. Unclipped, a few hard prompts at R = 1
    # (confident drafts, rejected) drive it so low that the rule stops drafting on the easy ones
    # that follow, whose survivals it no longer sees but at probes.
    CORRECTION_RANGE = (0.8, 1.25)
    VERIFY_SCALE_RANGE = (0.5, 6.0)
    VERIFY_MIN_STEPS = 16  # drafted steps of R's class before its scales are fitted
    VERIFY_ALPHA = 0.05  # the forward's scales average over ~the last 40 drafted steps
    VERIFY_RIDGE = 0.003  # pull of each draft-row scale towards the one before it (a <- b <- c)
    # steps (any R) after which R's measured plain rate is stale: in a benchmark's 16-request
    # cell one measured 319 tok/s in another cell's long-context tail was never refreshed while
    # the rule drafted (the cell's own plain steps ran at ~410), and it drafted 231 of 241
    # steps at 0.96x plain decoding
    PLAIN_STALE_STEPS = 32
    PAIR_RUN = 8  # a paired reading compares a step with the last ≤ 8 steps of the run before it
    PAIR_RUN_MIN = 3  # ... of at least 3 steps
    PAIR_ALPHA = 0.3  # weight of the newest paired reading (~ the last 3 mode changes)
    PAIR_MIN = 2  # paired readings of a class of R before `paired_ratio` answers

    def __init__(self, seconds: dict[int, float] | None = None, alpha: float = 0.2,
                 learn: bool = True, overhead_alpha: float = 0.1) -> None:
        """learn=False: keep the given costs (a schedule that does not depend on timing, e.g. for
        bit-reproducible sampled runs: the engine's measurements are then ignored)."""
        self.learn = learn
        self._draft = _ByRequests(seconds, alpha, extrapolate=True)
        self._overhead = {drafted: _ByRequests(None, overhead_alpha) for drafted in (True, False)}
        # (R, speculative) -> [steps seen, EMA of tokens per step, EMA of seconds per step]
        self._rates: dict[tuple[int, bool], list[float]] = {}
        self._uniform_rates: dict[int, list[float]] = {}  # the same for uniform-shape steps, by R
        self._predicted: dict[int, list[float]] = {}  # R -> [predictions, EMA of the predicted rate]
        # class of R (R.bit_length()) -> [steps, EMAs of the 3x3 Gram matrix of (base, rows,
        # beyond) (row-major) and of each of them times the forward's seconds]
        self._verify: dict[int, list[float]] = {}
        self._scales: dict[int, tuple[float, float, float]] = {}  # class of R -> fitted (a, b, c)
        self._steps = 0  # whole steps observed (`observe_rate`)
        self._plain_seen: dict[int, int] = {}  # R -> `_steps` at its last plain step (or planned probe)
        self._refresh: set[int] = set()  # R whose next plain step replaces its plain average
        # R -> (mode of its latest steps, their (tokens, seconds), at most PAIR_RUN)
        self._run: dict[int, tuple[str, deque[tuple[float, float]]]] = {}
        # (class of R, mode, against) -> [readings, moving average of ln(mode's rate / against's)]
        self._paired: dict[tuple[int, str, str], list[float]] = {}

    def observe(self, num_requests: int, seconds: float) -> None:
        if self.learn:
            self._draft.observe(num_requests, seconds)

    def __call__(self, num_requests: int) -> float | None:
        """Seconds of propose at R, or None before any measurement."""
        return self._draft(num_requests)

    def observe_overhead(self, num_requests: int, drafted: bool, seconds: float) -> None:
        if self.learn:
            self._overhead[drafted].observe(num_requests, seconds)

    def observe_verify(self, num_requests: int, seconds: float, base_s: float, rows_s: float,
                       beyond_s: float = 0.0) -> None:
        """A drafted step's target forward took `seconds`; the table prices its R anchor rows at
        `base_s`, its first R draft rows at `rows_s` more and the rest at `beyond_s` more. Refits
        R's class (`verify_scale`)."""
        if not self.learn:
            return
        c = num_requests.bit_length()
        cell = self._verify.setdefault(c, [0] + [0.0] * 12)
        x = (base_s, rows_s, beyond_s)
        self._average(cell, *(u * v for u in x for v in x), *(u * seconds for u in x),
                      alpha=self.VERIFY_ALPHA)
        if cell[0] >= self.VERIFY_MIN_STEPS and cell[1] > 0:
            # in Python floats: numpy's solve of a 3x3 system, run cold after the target's forward,
            # cost more than the rest of the step's bookkeeping (`dspark.runtime.policy_kernels`)
            gram, xy = [cell[1:4], cell[4:7], cell[7:10]], cell[10:13]
            # ridge: pulls a towards b and b towards c, so scales the steps do not tell apart are
            # read equal (a busier machine than the profile's as a whole, or no step beyond R
            # rows); each pull in proportion to the two rows' own weight, so that the rare steps
            # beyond R rows (the ranked probes among uniform steps) still set c
            for i in (0, 1):  # (+ a trace of the anchors' weight: steps without draft rows)
                w = self.VERIFY_RIDGE * (cell[1 + 4 * i] + cell[5 + 4 * i]) + 1e-6 * cell[1]
                gram[i][i] += w
                gram[i + 1][i + 1] += w
                gram[i][i + 1] -= w
                gram[i + 1][i] -= w
            lo, hi = self.VERIFY_SCALE_RANGE
            a, b, c3 = (min(max(x, lo), hi) for x in solve3(gram, xy))
            self._scales[c] = (a, b, c3)

    def verify_scale(self, num_requests: int) -> tuple[float, float, float]:
        """(anchor-row, first-R-draft-row, further-draft-row) scales for R's class (R.bit_length():
        they vary slowly with R): the forward ≈ a·base + b·rows + c·beyond, least squares over
        recent drafted steps, pulled towards a = b = c (ridge) so that a forward that is slower as
        a whole (a busier machine than the profile's) is not read as costly draft rows when
        budgets vary little. Within VERIFY_SCALE_RANGE; (1, 1, 1) until VERIFY_MIN_STEPS drafted
        steps."""
        return self._scales.get(num_requests.bit_length(), (1.0, 1.0, 1.0))

    def verify_scales(self) -> dict[int, list[float]]:
        """{R class's smallest R: [a, b, c]} (for reports)."""
        return {1 << (c - 1): list(self.verify_scale(1 << (c - 1))) for c in sorted(self._verify)}

    def overhead(self, num_requests: int, drafted: bool) -> float:
        """Seconds a step of R requests takes beyond propose and the SPS table (0 until measured)."""
        return self._overhead[drafted](num_requests) or 0.0

    def plain_step(self, num_requests: int, base_s: float) -> float:
        """Seconds of a plain step of R requests whose forward the table prices at `base_s`:
        base_s + o_p(R), but at most what a drafted step costs without its draft rows and
        propose, a·base_s + o_d(R) (a: `verify_scale`), once drafted steps are measured. A plain
        step does a subset of a drafted step's work, and o_p is learnt from the few plain steps
        a drafting engine runs: in a closed loop at 8 requests its few (slow) ones
        priced every plain step 22 ms dearer than a drafted step's overhead, and since the rule
        then kept drafting, no plain step ever corrected it."""
        plain = base_s + self.overhead(num_requests, False)
        drafted = self._overhead[True](num_requests)
        if drafted is None:
            return plain
        return min(plain, self.verify_scale(num_requests)[0] * base_s + drafted)

    def observe_rate(self, num_requests: int, speculative: bool, tokens: int, seconds: float,
                     uniform: bool = False) -> None:
        """A step of R requests emitted `tokens` in `seconds`, counted whole: a speculative step
        (it verified drafts) with the propose that made them, a plain one without the propose
        it may have run for the step after. uniform: a speculative step of the uniform shape
        (counted apart from the ranked ones the model predicts)."""
        if not self.learn or seconds <= 0:
            return
        self._steps += 1
        restart = False
        if not speculative:  # a stale plain rate (or a planned probe's): the fresh step replaces it
            restart = self.plain_stale(num_requests) or num_requests in self._refresh
            self._refresh.discard(num_requests)
            self._plain_seen[num_requests] = self._steps
        # tokens and seconds averaged apart (a ratio of averages, not an average of ratios: one
        # lucky step weighs its share)
        cell = (self._uniform_rates.setdefault(num_requests, [0, 0.0, 0.0]) if speculative and uniform
                else self._rates.setdefault((num_requests, speculative), [0, 0.0, 0.0]))
        self._average(cell, tokens, seconds, alpha=1.0 if restart else None)
        self._pair(num_requests, ("uniform" if uniform else "ranked") if speculative else "plain",
                   tokens, seconds)

    def _pair(self, num_requests: int, mode: str, tokens: float, seconds: float) -> None:
        """A step of `mode` at R: a paired reading if the run of steps at R before it was of
        another mode (and long enough), then the step joins (or starts) R's run."""
        run = self._run.get(num_requests)
        if run is None or run[0] != mode:
            if run is not None and len(run[1]) >= self.PAIR_RUN_MIN:
                before = sum(t for t, _ in run[1]) / sum(s for _, s in run[1])
                if tokens > 0 and before > 0:
                    x, c = math.log(tokens / seconds / before), num_requests.bit_length()
                    self._average(self._paired.setdefault((c, mode, run[0]), [0, 0.0]), x,
                                  alpha=self.PAIR_ALPHA)
                    self._average(self._paired.setdefault((c, run[0], mode), [0, 0.0]), -x,
                                  alpha=self.PAIR_ALPHA)
            run = self._run[num_requests] = (mode, deque(maxlen=self.PAIR_RUN))
        run[1].append((tokens, seconds))

    def paired_ratios(self) -> dict[str, dict[int, float]]:
        """{"mode/against": {class of R's smallest R: paired ratio}} with PAIR_MIN readings (for reports)."""
        out: dict[str, dict[int, float]] = {}
        for (c, mode, against), cell in sorted(self._paired.items()):
            if cell[0] >= self.PAIR_MIN:
                out.setdefault(f"{mode}/{against}", {})[1 << (c - 1)] = math.exp(cell[1])
        return out

    def paired_ratio(self, num_requests: int, mode: str, against: str) -> float | None:
        """`mode`'s rate over `against`'s at R's class from paired readings (each a step and the
        steps just before it: `_pair`), None until PAIR_MIN of them."""
        cell = self._paired.get((num_requests.bit_length(), mode, against))
        return None if cell is None or cell[0] < self.PAIR_MIN else math.exp(cell[1])

    def plain_stale(self, num_requests: int) -> bool:
        """R's plain rate is measured, but no plain step has run at R for PLAIN_STALE_STEPS steps."""
        seen = self._plain_seen.get(num_requests)
        return seen is not None and self._steps - seen >= self.PLAIN_STALE_STEPS

    def plan_plain_probe(self, num_requests: int) -> None:
        """The coming step at R runs plain to re-measure plain decoding: its rate replaces R's
        plain average, and R is not stale meanwhile (its rate arrives after the next decision)."""
        self._plain_seen[num_requests] = self._steps
        self._refresh.add(num_requests)

    def observe_prediction(self, num_requests: int, rate: float) -> None:
        """The rule's model predicted `rate` tokens/second for a speculative step of R requests."""
        if not self.learn:
            return
        self._average(self._predicted.setdefault(num_requests, [0, 0.0]), rate)

    def _average(self, cell: list[float], *values: float, alpha: float | None = None) -> None:
        """One more observation: cell[0] counts them, cell[1:] average `values`: the plain mean
        for the first 1/α, a moving average (weight α, default RATE_ALPHA, on the newest) after."""
        cell[0] += 1
        w = max(self.RATE_ALPHA if alpha is None else alpha, 1.0 / cell[0])
        for i, v in enumerate(values, 1):
            cell[i] += w * (v - cell[i])

    def _measured(self, num_requests: int, speculative: bool) -> float | None:
        return self._rate_of(self._rates.get((num_requests, speculative)))

    def _rate_of(self, cell: list[float] | None) -> float | None:
        return None if cell is None or cell[0] < self.RATE_MIN_STEPS else cell[1] / cell[2]

    def nearest_uniform(self, num_requests: int) -> tuple[int, float] | None:
        """(R', its measured uniform rate) for the measured R' nearest R in R's class
        (R.bit_length(): R' = R if measured), or None."""
        measured = [(abs(r - num_requests), r, rate) for r, cell in self._uniform_rates.items()
                    if r.bit_length() == num_requests.bit_length()
                    and (rate := self._rate_of(cell)) is not None]
        return min(measured)[1:] if measured else None

    def plain_rate(self, num_requests: int) -> float | None:
        """Tokens/second plain steps of exactly R requests delivered (None: too few measured)."""
        return self._measured(num_requests, False)

    def speculative_correction(self, num_requests: int) -> float | None:
        """Measured ÷ predicted speculative rate at exactly R, within CORRECTION_RANGE (None: too
        few of either)."""
        measured, predicted = self._measured(num_requests, True), self._predicted.get(num_requests)
        if measured is None or predicted is None or predicted[0] < self.RATE_MIN_STEPS or predicted[1] <= 0:
            return None
        lo, hi = self.CORRECTION_RANGE
        return min(max(measured / predicted[1], lo), hi)

    def to_dict(self) -> dict[int, float]:
        return dict(sorted(self._draft.by_r.items()))

    def measured_rates(self) -> dict[str, dict[int, float]]:
        """{"speculative": {R: tokens/s}, "plain": {R: tokens/s}, "uniform": {R: tokens/s}}
        (for reports; "speculative": the ranked steps)."""
        cells = sorted(self._rates.items())
        rates = {kind: {r: cell[1] / cell[2] for (r, spec), cell in cells if spec == want}
                 for kind, want in (("speculative", True), ("plain", False))}
        rates["uniform"] = {r: cell[1] / cell[2] for r, cell in sorted(self._uniform_rates.items())}
        return rates

    def overheads(self) -> dict[str, dict[int, float]]:
        """{"drafted": {R: s}, "plain": {R: s}}: the measured step overheads (for reports)."""
        return {kind: dict(sorted(self._overhead[drafted].by_r.items()))
                for kind, drafted in (("drafted", True), ("plain", False))}
