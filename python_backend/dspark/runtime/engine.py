"""The speculative engine loop (docs/architecture.md §2): continuous batching over a `TargetLike` and an
optional `DrafterLike`. One implementation serves the CLI, benchmarks, `dspark eval` and
the Triton BLS model (which runs `step()` in a background thread with remote stubs), so
nothing here knows about transports. With no drafter, or policy `none`, it is plain
decoding through the same loop (ℓ = 0 for every request).

Per step: cancel → admit (prefill) → propose → STS survival → policy.decide → flatten
[x0, d_1..d_ℓ] per request → target.verify → verify_ragged → roll KV back to the accepted
length → drafter.extend with the taps of [x0, accepted drafts] → emit / finish / release."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.interfaces import DraftBlock, DrafterLike, TargetLike
from dspark.runtime.sampling import SamplingParams, param_tensors, sample, sampling_probs
from dspark.runtime.scheduler import make_policy, sts_survival
from dspark.runtime.sps import SPSTable
from dspark.runtime.verify import verify_ragged

# on_tokens(request_id, new_ids, finished, reason): reason is None until finished, then one
# of "stop" (stop token or string), "length" (max_tokens or max_seq_len), "cancelled".
TokenCallback = Callable[[str, list[int], bool, str | None], None]
TIMERS = ("prefill", "draft", "schedule", "verify", "accept", "other")


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    on_tokens: TokenCallback | None = None
    output: list[int] = field(default_factory=list)  # emitted tokens; output[-1] is the anchor x0
    finish_reason: str | None = None
    slot: int = -1
    notified: bool = False  # the final on_tokens call has been made
    drafting: bool = True  # False once the drafter failed for this request (its context is stale)
    generator: torch.Generator | None = None
    verify_steps: int = 0
    verify_emitted: int = 0  # tokens emitted by verify steps (the prefill token excluded)
    drafted: list[int] = field(default_factory=list)  # per draft position k: times proposed
    verified: list[int] = field(default_factory=list)  # ... times sent to the target (k ≤ ℓ)
    accepted: list[int] = field(default_factory=list)  # ... times accepted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tau(self) -> float:
        """Mean accepted length τ = tokens emitted / verify steps, the bonus included (architecture §9)."""
        return self.verify_emitted / max(self.verify_steps, 1)


@dataclass
class EngineMetrics:
    steps: int = 0
    verify_tokens: int = 0  # Σ N over steps (token batch sizes)
    verify_budget: int = 0  # Σ_steps Σ_r ℓ_r (the K the policy spent)
    last_budget: int = 0
    emitted: int = 0
    drafter_fallbacks: int = 0
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMERS, 0.0))
    drafted: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)  # histogram of accepted drafts n per request-step

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mean_budget_per_step"] = self.verify_budget / max(self.steps, 1)
        d["cond_acceptance"] = [a / v if v else None for a, v in zip(self.accepted, self.verified)]
        return d


class SpecEngine:
    def __init__(self, target: TargetLike, drafter: DrafterLike | None = None, policy=None,
                 sts_temperatures: Sequence[float] | None = None, max_batch_tokens: int = 4096,
                 sps: SPSTable | None = None) -> None:
        """policy: a `dspark.runtime.scheduler` policy, a spec string ("none", "fixed:3", "dspark" with
        `sps`, ...) or None (plain). sts_temperatures: default the drafter's own (calibration.json),
        padded with 1 (uncalibrated) to γ. Stop strings are the caller's (`dspark.runtime.text`):
        it cancels the request once its text matches."""
        self.target, self.drafter = target, drafter
        self.gamma = int(drafter.gamma) if drafter is not None else 0
        if isinstance(policy, str):
            policy = make_policy(policy, sps=sps, gamma=self.gamma, max_batch_tokens=max_batch_tokens)
        plain = drafter is None or policy is None or getattr(policy, "name", "") == "none"
        self.policy = None if plain else policy  # None: plain decoding, the drafter is never called
        self.max_batch_tokens = max_batch_tokens
        if sts_temperatures is None:
            sts_temperatures = getattr(drafter, "sts_temperatures", None)
        temps = list(sts_temperatures or [])[:self.gamma]
        self.sts_temperatures = torch.tensor(temps + [1.0] * (self.gamma - len(temps)), dtype=torch.float32)
        self.default_stop_ids = frozenset(getattr(target, "eos_token_ids", None) or ())
        self.reset_metrics()
        self._lock = threading.Lock()  # guards _waiting and _cancel (add/cancel come from any thread)
        self._wakeup = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._cancel: set[str] = set()
        self._active: dict[str, Request] = {}  # touched by the stepping thread only
        self._ids = itertools.count()

    def reset_metrics(self) -> None:
        g = self.gamma
        self.metrics = EngineMetrics(drafted=[0] * g, verified=[0] * g, accepted=[0] * g,
                                     accept_hist=[0] * (g + 1))

    # ---- requests (thread-safe) ----
    def add_request(self, prompt: list[int], max_tokens: int, params: SamplingParams | None = None,
                    request_id: str | None = None, stop_token_ids: Sequence[int] | None = None,
                    on_tokens: TokenCallback | None = None) -> Request:
        """Queue a request; it is prefilled when a slot frees up. Returns its live `Request`."""
        if not 1 <= len(prompt) <= self.target.max_seq_len:
            raise ValueError(f"prompt length {len(prompt)} not in [1, max_seq_len={self.target.max_seq_len}]")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        params = params or SamplingParams()
        req = Request(request_id if request_id is not None else f"req-{next(self._ids)}", list(prompt),
                      int(max_tokens), params,
                      frozenset(self.default_stop_ids if stop_token_ids is None else stop_token_ids),
                      on_tokens, generator=params.generator(),
                      drafted=[0] * self.gamma, verified=[0] * self.gamma, accepted=[0] * self.gamma)
        with self._lock:
            self._waiting.append(req)
            self._wakeup.notify_all()
        return req

    def cancel(self, request_id: str) -> None:
        """Finish the request with reason "cancelled" and free its slot at the next step boundary."""
        with self._lock:
            self._cancel.add(request_id)
            self._wakeup.notify_all()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._active)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # ---- the loop ----
    def step(self) -> None:
        """One engine step for every active request (docs/architecture.md §2)."""
        t_start = time.perf_counter()
        clock = {k: 0.0 for k in TIMERS}
        self._apply_cancellations()
        t = time.perf_counter()
        self._admit()
        clock["prefill"] = time.perf_counter() - t
        reqs = [r for r in self._active.values() if not r.finished]
        if reqs:
            self._decode(reqs, clock)
        for req in list(self._active.values()):
            if req.finished:
                self._release(req)
        clock["other"] = time.perf_counter() - t_start - sum(clock.values())
        for k, v in clock.items():
            self.metrics.time_s[k] += v

    def _decode(self, reqs: list[Request], clock: dict[str, float]) -> None:
        R, g, t = len(reqs), self.gamma, time.perf_counter()
        anchors = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64)
        remaining = torch.tensor([self._remaining(r) for r in reqs], dtype=torch.int64)
        block = self._propose(reqs, anchors) if self.policy is not None else None
        clock["draft"] += time.perf_counter() - t
        t = time.perf_counter()
        if block is not None:
            survival = sts_survival(block.conf_logits, self.sts_temperatures)
            survival = survival * torch.tensor([r.drafting for r in reqs])[:, None]  # failed drafters: ℓ = 0
            ells = self.policy.decide(survival, remaining).to(torch.int64)
            ells = torch.minimum(ells.clamp(0, g), (remaining - 1).clamp(min=0))  # architecture §7 caps
        else:
            block = DraftBlock(torch.zeros(R, max(g, 1), dtype=torch.int64), None, torch.zeros(R, max(g, 1)))
            ells = torch.zeros(R, dtype=torch.int64)
        ell = ells.tolist()
        starts = [self.target.length(r.slot) for r in reqs]
        drafts = block.tokens.tolist()
        new_tokens = [[r.output[-1]] + drafts[i][:ell[i]] for i, r in enumerate(reqs)]
        batch = RaggedBatch.from_requests([r.slot for r in reqs], new_tokens, starts)
        clock["schedule"] += time.perf_counter() - t
        t = time.perf_counter()
        logits, taps = self.target.verify(batch)
        clock["verify"] += time.perf_counter() - t
        t = time.perf_counter()
        res = verify_ragged(logits, block.tokens, block.probs, ells, batch.cu_seqlens,
                            [r.params for r in reqs], [r.generator for r in reqs])
        n_acc, n_emit, out = res.num_accepted.tolist(), res.num_emitted.tolist(), res.tokens.tolist()
        cu = batch.cu_seqlens.tolist()
        for i, r in enumerate(reqs):
            self.target.rollback(r.slot, starts[i] + 1 + n_acc[i])  # keep x0 and the accepted drafts
            self._count(r, ell[i], n_acc[i])
            self._emit(r, out[i][:n_emit[i]], from_verify=True)
        self.metrics.steps += 1
        self.metrics.verify_tokens += batch.num_tokens
        self.metrics.last_budget = sum(ell)
        self.metrics.verify_budget += sum(ell)
        clock["accept"] += time.perf_counter() - t
        t = time.perf_counter()
        if self.policy is not None:  # drafter context gets [x0, accepted] even at ℓ = 0 (arch. §5)
            live = [i for i, r in enumerate(reqs) if not r.finished and r.drafting]
            self._drafter_call(
                [reqs[i] for i in live], self.drafter.extend, [reqs[i].slot for i in live],
                [batch.tokens[cu[i]:cu[i] + 1 + n_acc[i]] for i in live],
                [taps[cu[i]:cu[i] + 1 + n_acc[i]] for i in live])
        clock["draft"] += time.perf_counter() - t

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def run_forever(self, stop: threading.Event, idle_poll_s: float = 0.05) -> None:
        """Serving loop for a background thread (the Triton BLS model): step while there is
        work, sleep on add_request/cancel otherwise, return once `stop` is set."""
        while not stop.is_set():
            with self._wakeup:
                self._wakeup.wait_for(lambda: self._waiting or self._active or self._cancel, idle_poll_s)
            if self.has_work():
                self.step()

    def abort(self, reason: str = "error") -> None:
        """Finish every waiting and active request with `reason` and free all slots (e.g. after a
        target failure made the step raise). Call from the stepping thread."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for r in waiting + list(self._active.values()):
            if not r.finished:
                r.finish_reason = reason
            if r.slot < 0 and r.on_tokens and not r.notified:
                r.on_tokens(r.request_id, [], True, reason)
        for r in list(self._active.values()):
            self._release(r)

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """Run all prompts to completion (continuous batching over the free slots); returns the
        generated ids per prompt, a stop token included (default stops: the target's eos ids).
        With no drafter this is plain decoding, the oracle speculative output is tested against."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"generate got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.add_request(p, max_tokens, sp, stop_token_ids=stop_token_ids)
                for p, sp in zip(prompts, plist)]
        self.run_until_done()
        return [r.output for r in reqs]

    # ---- helpers ----
    def _remaining(self, r: Request) -> int:
        """Tokens r may still emit under max_tokens and the KV slot: the cache holds all but the
        last emitted token, so prompt + output ≤ max_seq_len + 1 (as TargetEngine.generate)."""
        return min(r.max_tokens - len(r.output), self.target.max_seq_len + 1 - len(r.prompt) - len(r.output))

    def _propose(self, reqs: list[Request], anchors: torch.Tensor) -> DraftBlock | None:
        """Drafts [R, γ] for every request; rows whose drafter failed earlier stay zero (ℓ = 0).
        A drafter exception makes this a plain step (still lossless) and counts a fallback."""
        rows = [i for i, r in enumerate(reqs) if r.drafting]
        if not rows:
            return None
        try:
            block = self.drafter.propose([reqs[i].slot for i in rows], anchors[rows],
                                         [reqs[i].params for i in rows], [reqs[i].generator for i in rows])
        except Exception:
            self.metrics.drafter_fallbacks += 1
            return None
        if len(rows) == len(reqs):
            return block
        idx, R = torch.tensor(rows), len(reqs)
        full = lambda x: None if x is None else x.new_zeros((R, *x.shape[1:])).index_copy_(0, idx, x)
        return DraftBlock(full(block.tokens), full(block.probs), full(block.conf_logits))

    def _drafter_call(self, reqs: list[Request], fn, *args) -> None:
        """Run a state-changing drafter call; on failure those requests stop drafting (plain from now)."""
        if not reqs:
            return
        try:
            fn(*args)
        except Exception:
            self.metrics.drafter_fallbacks += 1
            for r in reqs:
                r.drafting = False

    def _count(self, r: Request, ell: int, n: int) -> None:
        m = self.metrics
        r.verify_steps += 1
        if self.policy is None:
            return
        m.accept_hist[n] += 1
        for per in (r, m):
            for k in range(self.gamma if r.drafting else 0):
                per.drafted[k] += 1
            for k in range(ell):
                per.verified[k] += 1
            for k in range(n):
                per.accepted[k] += 1

    def _apply_cancellations(self) -> None:
        with self._lock:
            ids, self._cancel = self._cancel, set()
            waiting = [r for r in self._waiting if r.request_id in ids]
            self._waiting = deque(r for r in self._waiting if r.request_id not in ids)
        for r in waiting + [self._active[i] for i in ids if i in self._active]:
            if not r.finished:
                r.finish_reason = "cancelled"
                if r.slot < 0 and r.on_tokens:  # never admitted: report here, admitted ones in _release
                    r.on_tokens(r.request_id, [], True, "cancelled")
                    r.notified = True

    def _admit(self) -> None:
        """Continuous batching: prefill waiting requests while slots (and the token budget) allow."""
        new: list[Request] = []
        with self._lock:
            budget, free = self.max_batch_tokens, self.target.num_free_slots()
            while self._waiting and len(new) < free and (not new or len(self._waiting[0].prompt) <= budget):
                new.append(self._waiting.popleft())
                budget -= len(new[-1].prompt)
        if not new:
            return
        for r in new:
            r.slot = self.target.allocate()
            self._active[r.request_id] = r
        logits, taps = self.target.prefill([r.slot for r in new], [r.prompt for r in new])
        if all(r.params.greedy for r in new):
            first = logits.argmax(-1).tolist()  # == sampling_probs' one-hot (ties: lowest id)
        else:  # generators live on the CPU (verify_ragged draws from them there too)
            probs = sampling_probs(logits.float(), *param_tensors([r.params for r in new], logits.device))
            first = sample(probs.cpu(), [r.generator for r in new]).tolist()
        if self.policy is not None:
            for r, tp in zip(new, taps):
                self._drafter_call([r], self.drafter.start, r.slot, r.prompt, tp)
        for r, tok in zip(new, first):
            self._emit(r, [tok], from_verify=False)

    def _emit(self, r: Request, new: list[int], from_verify: bool) -> None:
        """Append tokens, truncating at a stop token / length; stream them."""
        room = self._remaining(r)
        for j, tok in enumerate(new[:room]):
            if tok in r.stop_token_ids:
                new, r.finish_reason = new[:j + 1], "stop"
                break
        else:
            new = new[:room]
            if len(new) == room:
                r.finish_reason = "length"
        r.output.extend(new)
        r.verify_emitted += len(new) if from_verify else 0
        self.metrics.emitted += len(new)
        if r.on_tokens and (new or r.finished):
            r.on_tokens(r.request_id, new, r.finished, r.finish_reason)
            r.notified = r.finished

    def _release(self, r: Request) -> None:
        del self._active[r.request_id]
        self.target.release(r.slot)
        if self.policy is not None:
            try:
                self.drafter.release(r.slot)
            except Exception:
                self.metrics.drafter_fallbacks += 1
        if r.on_tokens and not r.notified:  # cancelled while active
            r.on_tokens(r.request_id, [], True, r.finish_reason)
