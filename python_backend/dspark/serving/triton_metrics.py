"""Engine and request metrics on Triton's metrics port (architecture §10) via the Python backend's
`pb_utils.MetricFamily`: counters are advanced by the deltas of `EngineMetrics` since the
last `update`, gauges are set, and per-request latencies go to histograms with AIPerf's
definitions (`observe_request`). `pb_utils` is passed in because it exists only inside the
backend stub; everything else here is plain Python, so the delta logic is testable anywhere.
The names are a stable API (model_repository/README.md lists them; dashboards query them).

Every metric call is one message from the stub to the server, so `update` runs on a
timer (not per engine step) and skips counters that did not move."""

from __future__ import annotations

import threading

from dspark.runtime.engine import EngineMetrics

PREFIX = "dspark_"
COUNTERS = {  # name -> (EngineMetrics attribute or per-position list summed, description)
    "steps_total": ("steps", "Engine steps (one target verify forward each)."),
    "drafted_tokens_total": ("drafted", "Draft tokens proposed by the drafter."),
    "verified_tokens_total": ("verified", "Draft tokens sent to the target for verification (sum of l_r)."),
    "accepted_tokens_total": ("accepted", "Draft tokens accepted by lossless verification (bonus excluded)."),
    "emitted_tokens_total": ("emitted", "Tokens emitted to requests (accepted + bonus + prefill)."),
    "drafter_fallbacks_total": ("drafter_fallbacks", "Drafter calls that failed; those steps ran plain."),
    "draft_steps_total": ("draft_steps", "Engine steps that drafted (the rest decoded plain)."),
}
# AIPerf: TTFT = first token time - request arrival; ITL = (last token - first token) / (tokens - 1);
# request latency = last response - arrival. Measured in the `dspark` model (server side).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "cancelled", "error", "shutdown")


def counter_values(m: EngineMetrics) -> dict[str, int]:
    """Current cumulative value of every counter in COUNTERS."""
    values = {}
    for name, (attr, _) in COUNTERS.items():
        v = getattr(m, attr, 0)
        values[name] = sum(v) if isinstance(v, list) else int(v)
    return values


class TritonEngineMetrics:
    """Owns the metric families/metrics of one `dspark` model instance."""

    def __init__(self, pb_utils, gamma: int, labels: dict[str, str] | None = None) -> None:
        fam = pb_utils.MetricFamily
        self.labels = dict(labels or {})
        self.gamma = gamma
        self._families, self._counters = [], {}
        for name, (_, doc) in COUNTERS.items():
            self._counters[name] = self._metric(fam(PREFIX + name, doc, fam.COUNTER))
        budget_doc = "Verify budget K = sum_r l_r of the last step."
        self.budget = self._metric(fam(PREFIX + "verify_budget", budget_doc, fam.GAUGE))
        self.active = self._metric(fam(PREFIX + "active_requests", "Requests holding a KV slot.", fam.GAUGE))
        pending_doc = "Requests accepted by the model and not yet finished (queued + active)."
        self.pending = self._metric(fam(PREFIX + "pending_requests", pending_doc, fam.GAUGE))
        self.queued = self._metric(
            fam(PREFIX + "queued_requests", "Requests waiting for a KV slot.", fam.GAUGE)
        )
        self.cancelled = self._metric(
            fam(
                PREFIX + "cancelled_requests_total",
                "Requests the client cancelled or abandoned (disconnect); their slot was freed.",
                fam.COUNTER,
            )
        )
        finished = self._family(
            fam(
                PREFIX + "finished_requests_total",
                "Requests finished, by reason (stop, length, cancelled, error, shutdown).",
                fam.COUNTER,
            )
        )
        self.finished = {r: finished.Metric(labels=self.labels | {"reason": r}) for r in FINISH_REASONS}
        self.ttft = self._family(
            fam(
                PREFIX + "time_to_first_token_seconds",
                "Request arrival to its first generated token (AIPerf TTFT).",
                fam.HISTOGRAM,
            )
        ).Metric(labels=self.labels, buckets=list(TTFT_BUCKETS))
        self.itl = self._family(
            fam(
                PREFIX + "inter_token_latency_seconds",
                "(last token - first token) / (output tokens - 1) per request (AIPerf ITL).",
                fam.HISTOGRAM,
            )
        ).Metric(labels=self.labels, buckets=list(ITL_BUCKETS))
        self.latency = self._family(
            fam(
                PREFIX + "request_latency_seconds",
                "Request arrival to its final response (AIPerf request latency).",
                fam.HISTOGRAM,
            )
        ).Metric(labels=self.labels, buckets=list(LATENCY_BUCKETS))
        position = self._family(
            fam(
                PREFIX + "position_acceptance",
                "P(draft k accepted | drafts before k accepted), cumulative.",
                fam.GAUGE,
            )
        )
        self.position = [position.Metric(labels=self.labels | {"position": str(k + 1)}) for k in range(gamma)]
        hist = self._family(
            fam(
                PREFIX + "acceptance_length",
                "Accepted draft tokens per request-step (bonus excluded).",
                fam.HISTOGRAM,
            )
        )
        self.hist = hist.Metric(labels=self.labels, buckets=[float(b) for b in range(max(gamma, 1) + 1)])
        self._last_counts = dict.fromkeys(COUNTERS, 0)
        self._last_hist = [0] * (gamma + 1)
        self._lock = threading.Lock()

    def _family(self, family):
        self._families.append(family)
        return family

    def _metric(self, family):
        return self._family(family).Metric(labels=self.labels)

    def observe_request(
        self,
        reason: str,
        ttft_s: float | None,
        itl_s: float | None,
        latency_s: float | None,
        client_cancelled: bool = False,
    ) -> None:
        """One finished request (any thread). Latencies are observed for completed requests only
        (reason stop / length), as AIPerf reports them; None = not applicable."""
        with self._lock:
            if reason in self.finished:
                self.finished[reason].increment(1)
            if client_cancelled:
                self.cancelled.increment(1)
            if reason in ("stop", "length"):
                for hist, value in ((self.ttft, ttft_s), (self.itl, itl_s), (self.latency, latency_s)):
                    if value is not None:
                        hist.observe(float(value))

    def update(self, m: EngineMetrics, active: int, pending: int) -> None:
        """Push the deltas of `m` since the last call (safe to call from any thread)."""
        with self._lock:
            values = counter_values(m)
            for name, value in values.items():
                if value > self._last_counts[name]:
                    self._counters[name].increment(value - self._last_counts[name])
            self._last_counts = values
            hist = list(m.accept_hist)
            for n, (now, before) in enumerate(zip(hist, self._last_hist)):
                for _ in range(now - before):  # a histogram takes one observation at a time
                    self.hist.observe(float(n))
            self._last_hist = hist
            for k, gauge in enumerate(self.position):
                if m.verified[k]:
                    gauge.set(m.accepted[k] / m.verified[k])
            self.budget.set(float(m.last_budget))
            self.active.set(float(active))
            self.pending.set(float(pending))
            self.queued.set(float(max(pending - active, 0)))

    def close(self) -> None:
        """Drop metrics before their families (the backend requires that order)."""
        self._counters, self.position, self.hist, self.finished = {}, [], None, {}
        self.budget = self.active = self.pending = self.queued = self.cancelled = None
        self.ttft = self.itl = self.latency = None
        self._families = []
