"""The speculative engine loop (architecture §2): continuous batching over a `TargetLike` and an
optional `DrafterLike`. One implementation serves the CLI, benchmarks, `dspark eval` and the
Triton `dspark` model (which runs `step()` in a background thread), so nothing here knows about
transports. With no drafter, or policy `none`, it is plain decoding through the same loop
(ℓ = 0 for every request).

Per step: cancel → admit (prefill) → drafts (proposed at the end of the previous step) → STS
survival → policy.decide → flatten [x0, d_1..d_ℓ] per request → draft_probs of the verified
sampled rows → target.verify → verify_ragged → drafter.extend with the taps of [x0, accepted]
→ propose the NEXT step's drafts → one host sync → roll the KV back, emit / finish / release.

Device-first: drafts, confidences, logits, acceptance and the next step's drafts stay on the
target's device; the host waits once per step, for (accepted counts, tokens, next survivals)
together. Steps that admit new requests also wait for their first token and first drafts."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.deferred_extend import DeferredExtend
from dspark.runtime.interfaces import DraftBlock, DrafterLike, TargetLike
from dspark.runtime.sampling import (
    STREAM_DRAFT,
    STREAM_FIRST,
    STREAM_VERIFY,
    SamplingBatch,
    SamplingParams,
    philox_uniforms,
    sample_inverse_cdf,
)
from dspark.runtime.scheduler import Policy, make_policy, sts_survival
from dspark.runtime.sps import SPSTable
from dspark.runtime.verify import verify_ragged

log = logging.getLogger(__name__)

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
    rng_key: int = 0  # Philox key: the uniforms of step s are philox(rng_key, s, stream)
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
    draft_steps: int = 0  # steps that drafted (the rest were plain: no drafter, or skipped by the policy)
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


@dataclass
class _Drafts:
    """Drafts proposed at the end of a step for the next one: request id -> row."""

    rows: dict[str, int]
    tokens: torch.Tensor  # [M, w] i64 (device), w ≤ γ: the policy's draft width
    survival: torch.Tensor  # [M, w] f32 (host, arrives with the step's one sync)
    sources: torch.Tensor | None  # [M] i64 host: the drafter's proposer per row (None: one)


def _to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Copy device tensors to the host with ONE wait (non-blocking copies, then a stream sync)."""
    cuda = [t for t in tensors if t is not None and t.is_cuda]
    if not cuda:
        return list(tensors)
    out = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(cuda[0].device).synchronize()
    return out


def step_uniforms(reqs: list[Request], keys: torch.Tensor, counters: torch.Tensor, width: int,
                  stream: int) -> torch.Tensor:
    """The step's Philox uniforms [R, width]; zeros when every request is greedy (greedy drafting
    and acceptance read none, and Philox costs ~0.6 ms a call on this CPU: 5 % of a batch-1 step)."""
    if all(r.params.greedy for r in reqs):
        return torch.zeros(len(reqs), width, device=keys.device)
    return philox_uniforms(keys, counters, width, stream)


class SpecEngine:
    def __init__(self, target: TargetLike, drafter: DrafterLike | None = None, policy=None,
                 sts_temperatures: Sequence[float] | None = None, max_batch_tokens: int = 4096,
                 sps: SPSTable | None = None, sts_shifts: Sequence[float] | None = None) -> None:
        """policy: a `dspark.runtime.scheduler` policy, a spec string ("none", "fixed:3", "dspark" with
        `sps`, ...) or None (plain). sts_temperatures: default the drafter's own (calibration.json),
        padded with 1 (uncalibrated) to γ; sts_shifts (affine STS): likewise, padded with 0. Stop
        strings are the caller's (`dspark.runtime.text`): it cancels the request once its text matches."""
        self.target, self.drafter = target, drafter
        self.gamma = int(drafter.gamma) if drafter is not None else 0
        if isinstance(policy, str):
            policy = make_policy(policy, sps=sps, gamma=self.gamma, max_batch_tokens=max_batch_tokens)
        plain = drafter is None or policy is None or getattr(policy, "name", "") == "none"
        self.policy: Policy | None = None if plain else policy  # None: plain decoding, no drafter calls
        if self.policy is not None:  # sources whose confidences the drafter calibrates itself online
            self.policy.calibrated_sources = frozenset(getattr(drafter, "calibrated_sources", None) or ())
        self.max_batch_tokens = max_batch_tokens
        self.device = torch.device(getattr(target, "device", "cpu"))
        def per_position(values: Sequence[float] | None, attr: str, fill: float) -> torch.Tensor:
            values = list((getattr(drafter, attr, None) if values is None else values) or [])[:self.gamma]
            return torch.tensor(values + [fill] * (self.gamma - len(values)), dtype=torch.float32,
                                device=self.device)

        self.sts_temperatures = per_position(sts_temperatures, "sts_temperatures", 1.0)
        self.sts_shifts = per_position(sts_shifts, "sts_shifts", 0.0)
        self.default_stop_ids = frozenset(getattr(target, "eos_token_ids", None) or ())
        self.reset_metrics()
        self._lock = threading.Lock()  # guards _waiting and _cancel (add/cancel come from any thread)
        self._wakeup = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._cancel: set[str] = set()
        self._active: dict[str, Request] = {}  # touched by the stepping thread only
        self._ids = itertools.count()
        self._next: _Drafts | None = None  # drafts proposed at the end of the last step
        self._next_s = 0.0  # seconds of the last step's propose for this one (counted with this step)
        self._draft_next: bool | None = None  # the policy's draft/skip choice for the next step
        self._deferred = DeferredExtend()  # x0 rows of skipped steps, not yet in the drafter's context
        self._logged_failures: set[str] = set()  # drafter calls whose first failure was logged
        self._step_drafter_calls, self._step_drafter_s = 0, 0.0  # this step's drafter calls, propose time

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
                      on_tokens, rng_key=params.rng_key(),
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
        """One engine step for every active request (architecture §2)."""
        t_start = time.perf_counter()
        clock = {k: 0.0 for k in TIMERS}
        self._apply_cancellations()
        t = time.perf_counter()
        self._admit()
        clock["prefill"] = time.perf_counter() - t
        reqs = [r for r in self._active.values() if not r.finished]
        if reqs:
            self._decode(reqs, clock)
        else:
            self._next, self._next_s = None, 0.0
        for req in list(self._active.values()):
            if req.finished:
                self._release(req)
        clock["other"] = time.perf_counter() - t_start - sum(clock.values())
        for k, v in clock.items():
            self.metrics.time_s[k] += v

    def _decode(self, reqs: list[Request], clock: dict[str, float]) -> None:
        R, g, dev, t = len(reqs), self.gamma, self.device, time.perf_counter()
        t_step, self._step_drafter_s, self._step_drafter_calls = t, 0.0, 0
        sampling = SamplingBatch.from_params([r.params for r in reqs], dev)
        keys = torch.tensor([r.rng_key for r in reqs], dtype=torch.int64).to(dev)
        counters = torch.tensor([r.verify_steps for r in reqs], dtype=torch.int64).to(dev)
        anchors = torch.tensor([r.output[-1] for r in reqs], dtype=torch.int64).to(dev)
        drafts, survival, sources = self._drafts(reqs, anchors, keys, counters)
        width = self._parts()[1].draft_width() if survival is not None else 0
        clock["draft"] += time.perf_counter() - t

        t = time.perf_counter()  # schedule (host): ℓ, then the flat batch [x0, d_1..d_ℓ] per request
        remaining = torch.tensor([self._remaining(r) for r in reqs], dtype=torch.int64)
        ells = torch.zeros(R, dtype=torch.int64)
        if survival is not None:
            # the drafted columns only: a narrow step's policy sees a [R, w] block
            ells = self._parts()[1].decide(survival[:, :width], remaining, sources).to(torch.int64)
            ells = torch.minimum(ells.clamp(0, width), (remaining - 1).clamp(min=0))  # architecture §7 caps
            ells = ells * torch.tensor([r.drafting for r in reqs])  # failed drafters: ℓ = 0
        batch = self._flat_batch(reqs, anchors, drafts, ells)
        clock["schedule"] += time.perf_counter() - t

        t = time.perf_counter()
        q = self._draft_probs(reqs, ells) if survival is not None else None
        clock["draft"] += time.perf_counter() - t
        t = time.perf_counter()
        logits, taps = self.target.verify(batch)
        verify_s = time.perf_counter() - t
        clock["verify"] += verify_s

        t = time.perf_counter()
        uniforms = step_uniforms(reqs, keys, counters, g + 1, STREAM_VERIFY)
        block = drafts if drafts is not None else torch.zeros(R, g, dtype=torch.int64, device=dev)
        res = verify_ragged(logits, block, ells, batch.cu_seqlens, sampling, q, uniforms)
        clock["accept"] += time.perf_counter() - t

        t = time.perf_counter()  # the drafter keeps up (also at ℓ = 0), then drafts the next step
        nxt, next_s, charge_next = None, 0.0, 0.0
        if self.policy is not None:
            self._draft_next = self._parts()[1].wants_draft(len(reqs))
            # nothing verified now and no drafts next step: the x0 rows wait for the next draft
            defer = not self._draft_next and not bool(ells.any())
            caught_up = 0 if defer or survival is not None else len(self._deferred)
            t_next = time.perf_counter()
            self._extend(reqs, batch, taps, res.num_accepted + 1, defer)
            catch_up_s = self._settle_drafter(caught_up, t_next)
            # a plain step before drafting resumes: its extend catches up the rows deferred over
            # the plain run, a cost of the drafted step that follows (counted with its propose)
            if survival is not None or defer:
                t_next = time.perf_counter()
            nxt = self._propose_next(reqs, res, keys, counters + 1, remaining - ells - 1)
            next_s = time.perf_counter() - t_next if nxt is not None else 0.0
            # ... but amortized: of a catch-up over k deferred steps, the drafted step carries
            # 1 / (k + 1), what it costs a step once drafting goes on (charged whole, at 16
            # requests a uniform step read 0.86x plain decoding in the rule's paired readings
            # while MTP-1 ran 1.02x plain end to end)
            if nxt is not None:
                charge_next = next_s - catch_up_s * caught_up / (caught_up + 1)
        clock["draft"] += time.perf_counter() - t

        t = time.perf_counter()
        host = _to_host(res.num_accepted, res.tokens, None if nxt is None else nxt.survival)  # the one sync
        if nxt is not None and host[2] is not None:
            nxt.survival = host[2]
        self._next = nxt
        if survival is not None:  # what the survivals predicted, against what was accepted
            self._parts()[1].observe_acceptance(survival[:, :width], ells, host[0].cpu(), sources)  # type: ignore[union-attr]
        n_acc: list[int] = host[0].tolist()  # type: ignore[union-attr]
        out: list[list[int]] = host[1].tolist()  # type: ignore[union-attr]
        ell: list[int] = ells.tolist()
        starts: list[int] = batch.positions[batch.cu_seqlens[:-1]].tolist()
        for i, r in enumerate(reqs):
            self.target.rollback(r.slot, starts[i] + 1 + n_acc[i])  # keep x0 and the accepted drafts
            self._count(r, ell[i], n_acc[i], drafted=survival is not None and r.drafting)
            self._emit(r, out[i][:n_acc[i] + 1], from_verify=True)
        m = self.metrics
        m.steps += 1
        m.draft_steps += survival is not None
        m.verify_tokens += batch.num_tokens
        m.last_budget = sum(ell)
        m.verify_budget += sum(ell)
        clock["accept"] += time.perf_counter() - t
        if self.policy is not None:  # the whole step, for the cost rule's step overheads and rates
            seconds = time.perf_counter() - t_step
            self.policy.observe_step(R, batch.num_tokens, self._step_drafter_calls > 0, seconds,
                                     self._step_drafter_s, verify_s)
            # the step as its mode costs: with the propose that made its drafts (last step), not
            # the one it ran for the next step
            speculative = survival is not None
            self.policy.observe_rate(R, speculative, sum(n_acc) + R,
                                     seconds - next_s + (self._next_s if speculative else 0.0))
        self._next_s = charge_next

    def _flat_batch(self, reqs: list[Request], anchors: torch.Tensor, drafts: torch.Tensor | None,
                    ells: torch.Tensor) -> RaggedBatch:
        """[x0_r, d_r1 .. d_rℓ_r] per request: metadata on the host, tokens gathered on the device."""
        R, g = len(reqs), self.gamma
        lens = ells + 1
        n = int(lens.sum())
        cu = torch.zeros(R + 1, dtype=torch.int64)
        cu[1:] = lens.cumsum(0)
        seq_idx = torch.repeat_interleave(torch.arange(R), lens, output_size=n)
        local = torch.arange(n) - cu[:-1].repeat_interleave(lens, output_size=n)
        starts = torch.tensor([self.target.length(r.slot) for r in reqs], dtype=torch.int64)
        if drafts is None or n == R:
            tokens = anchors
        else:
            grid = torch.cat([anchors[:, None], drafts], dim=1).reshape(-1)  # [R·(γ+1)]
            tokens = grid[(seq_idx * (g + 1) + local).to(anchors.device)]
        return RaggedBatch(tokens, seq_idx, starts.repeat_interleave(lens, output_size=n) + local, cu,
                           torch.tensor([r.slot for r in reqs], dtype=torch.int64))

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def run_forever(self, stop: threading.Event, idle_poll_s: float = 0.05) -> None:
        """Serving loop for a background thread (the Triton `dspark` model): step while there is
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
        self._next, self._next_s = None, 0.0

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

    # ---- drafting ----
    def _parts(self) -> tuple[DrafterLike, Policy]:
        """The drafter and policy of a speculative engine (only called when drafting is on)."""
        assert self.drafter is not None and self.policy is not None
        return self.drafter, self.policy

    def _remaining(self, r: Request) -> int:
        """Tokens r may still emit under max_tokens and the KV slot: the cache holds all but the
        last emitted token, so prompt + output ≤ max_seq_len + 1."""
        return min(r.max_tokens - len(r.output), self.target.max_seq_len + 1 - len(r.prompt) - len(r.output))

    def _drafts(self, reqs: list[Request], anchors: torch.Tensor, keys: torch.Tensor,
                counters: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """This step's drafts [R, γ] (device), survivals [R, γ] (host; both zero past the policy's
        draft width) and the drafter's proposer per row [R] (host, None: one), or Nones for a
        plain step. Requests drafted at the end of the last step reuse those drafts; the others
        (just admitted) are proposed now, which costs this step one extra host sync."""
        nxt, self._next = self._next, None
        draft = self._draft_next
        if self.policy is None or not (draft if draft is not None else self.policy.wants_draft(len(reqs))):
            return None, None, None
        R, g, dev = len(reqs), self.gamma, self.device
        have = [i for i, r in enumerate(reqs) if nxt is not None and r.request_id in nxt.rows]
        need = [i for i, r in enumerate(reqs) if r.drafting and (nxt is None or r.request_id not in nxt.rows)]
        tokens = torch.zeros(R, g, dtype=torch.int64, device=dev)
        survival = torch.zeros(R, g, dtype=torch.float32)
        sources: torch.Tensor | None = None
        if have and nxt is not None:
            rows = torch.tensor([nxt.rows[reqs[i].request_id] for i in have])
            w = nxt.tokens.shape[1]
            tokens[torch.tensor(have, device=dev), :w] = nxt.tokens[rows.to(dev)]
            survival[torch.tensor(have), :w] = nxt.survival[rows]
            if nxt.sources is not None:
                sources = torch.zeros(R, dtype=torch.int64)
                sources[torch.tensor(have)] = nxt.sources[rows]
        if need:
            idx = torch.tensor(need)
            block = self._propose([reqs[i] for i in need], anchors[idx.to(dev)], keys[idx.to(dev)],
                                  counters[idx.to(dev)])
            if block is not None:
                w = block.tokens.shape[1]
                tokens[idx.to(dev), :w] = block.tokens
                surv = sts_survival(block.conf_logits, self.sts_temperatures, self.sts_shifts)
                survival[idx, :w] = surv.float().cpu()
                if block.sources is not None:
                    sources = torch.zeros(R, dtype=torch.int64) if sources is None else sources
                    sources[idx] = block.sources.cpu()
        return tokens, survival, sources

    def _propose(self, reqs: list[Request], anchors: torch.Tensor, keys: torch.Tensor,
                 counters: torch.Tensor) -> DraftBlock | None:
        """drafter.propose for `reqs` at the policy's draft width w (the step verifies no more per
        request: MTP-1, a uniform step) -> a [R, w] block; a drafter exception counts a fallback
        and drafts nothing (those requests verify ℓ = 0 this step: still lossless). The width is
        decided before drafting, like the step's shape, so it is lossless too; Philox uniforms
        are prefix-stable, so a sampled draft at position k reads the same u at any width."""
        drafter, policy = self._parts()
        if not self._flush_deferred(reqs):  # the context first (not timed as t_draft: catch-up)
            return None
        width = policy.draft_width()
        t0 = time.perf_counter()
        self._step_drafter_calls += 1
        try:
            block = drafter.propose([r.slot for r in reqs], anchors, [r.params for r in reqs],
                                    step_uniforms(reqs, keys, counters, width, STREAM_DRAFT))
        except Exception:
            self._fallback("propose")
            return None
        seconds = time.perf_counter() - t0
        self._step_drafter_s += seconds
        policy.observe_draft(len(reqs), seconds, width)  # the cost rule's t_draft(R)
        if block.tokens.shape[1] != width:
            block = DraftBlock(block.tokens[:, :width], block.conf_logits[:, :width], block.sources)
        return block

    def _propose_next(self, reqs: list[Request], res, keys: torch.Tensor, counters: torch.Tensor,
                      left: torch.Tensor) -> _Drafts | None:
        """Draft the next step now, before the host has seen this step's results: anchors are the
        last emitted tokens on the device. Skipped when the policy says the next step should be
        plain (decided from step t−2 data: `_draft_next`), and for requests that finish for sure
        (left ≤ 0)."""
        live = [i for i, r in enumerate(reqs) if r.drafting and int(left[i]) > 0]
        if not self._draft_next or not live:
            return None
        dev = self.device
        idx = torch.tensor(live, device=dev)
        anchors = res.tokens.gather(1, res.num_accepted[:, None])[:, 0]
        block = self._propose([reqs[i] for i in live], anchors[idx], keys[idx], counters[idx])
        if block is None:
            return None
        return _Drafts({reqs[i].request_id: j for j, i in enumerate(live)}, block.tokens,
                       sts_survival(block.conf_logits, self.sts_temperatures, self.sts_shifts).float(),
                       None if block.sources is None else block.sources.cpu())

    def _draft_probs(self, reqs: list[Request], ells: torch.Tensor) -> torch.Tensor | None:
        """p_d of the verified drafts of sampled requests, flat [Σℓ, V] (None: one-hot drafts)."""
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy and int(ells[i]) > 0]
        if not rows:
            return None
        q = self._parts()[0].draft_probs([reqs[i].slot for i in rows], ells[rows])
        return None if q is None else q.to(self.device)

    def _extend(self, reqs: list[Request], batch: RaggedBatch, taps: torch.Tensor,
                keep: torch.Tensor, defer: bool = False) -> None:
        """drafter.extend with [x0, accepted drafts] of every drafting request (architecture §5).
        `defer` (a step with ℓ = 0 everywhere, followed by a plain step): the x0 rows are kept in
        `_deferred` and reach the drafter with its next call for those requests."""
        live = [i for i, r in enumerate(reqs) if r.drafting]
        if not live:
            return
        tokens, cu = batch.tokens, batch.cu_seqlens
        if len(live) < len(reqs):
            idx = torch.tensor(live)
            lens = (cu[1:] - cu[:-1])[idx]
            starts = cu[:-1][idx]
            n = int(lens.sum())
            first = torch.zeros(len(live), dtype=torch.int64)
            first[1:] = lens.cumsum(0)[:-1]
            rows = (starts.repeat_interleave(lens, output_size=n) + torch.arange(n)
                    - first.repeat_interleave(lens, output_size=n)).to(tokens.device)
            tokens, taps, keep = tokens[rows], taps[rows], keep[idx.to(keep.device)]
            cu = torch.zeros(len(live) + 1, dtype=torch.int64)
            cu[1:] = lens.cumsum(0)
        live_reqs = [reqs[i] for i in live]
        if defer:
            self._deferred.add([r.request_id for r in live_reqs], tokens, taps)
            if self._deferred.full:
                self._flush_deferred(live_reqs)
            return
        if not self._flush_deferred(live_reqs):
            return
        self._step_drafter_calls += 1
        try:
            self._parts()[0].extend([r.slot for r in live_reqs], tokens, taps, cu, keep)
        except Exception:  # those requests stop drafting (plain from now: still lossless)
            self._fallback("extend")
            for r in live_reqs:
                r.drafting = False

    def _settle_drafter(self, caught_up: int, since: float) -> float:
        """After a catch-up of `caught_up` deferred steps (0: none), the drafter runs the context
        work it holds (`flush`, where it has one: a lazy drafter would do it inside its next
        propose) -> seconds since `since` (the catch-up's extend and flush), else 0."""
        if not caught_up:
            return 0.0
        flush = getattr(self._parts()[0], "flush", None)
        if flush is not None:
            try:
                flush()
            except Exception:  # the next propose meets the same failure and falls back there
                pass
        return time.perf_counter() - since

    def _flush_deferred(self, reqs: list[Request]) -> bool:
        """Hand the deferred x0 rows of `reqs` to the drafter (one extend). False: it failed, and
        those requests stop drafting."""
        rows = self._deferred.take([r.request_id for r in reqs])
        if rows is None:
            return True
        self._step_drafter_calls += 1
        try:
            self._parts()[0].extend([reqs[i].slot for i in rows.which], rows.tokens, rows.taps,
                                    rows.cu_seqlens, rows.keep)
        except Exception:
            self._fallback("extend")
            for r in reqs:
                r.drafting = False
            return False
        return True

    def _fallback(self, call: str) -> None:
        """A drafter call failed: count it, and log the first failure of each call with its
        traceback (later ones only count: a broken drafter must not flood the log)."""
        self.metrics.drafter_fallbacks += 1
        if call not in self._logged_failures:
            self._logged_failures.add(call)
            log.warning("drafter %s failed; those requests decode plain (lossless). First failure:",
                        call, exc_info=True)

    def _count(self, r: Request, ell: int, n: int, drafted: bool) -> None:
        m = self.metrics
        r.verify_steps += 1
        if self.policy is None:
            return
        m.accept_hist[n] += 1
        for per in (r, m):
            for k in range(self.gamma if drafted else 0):
                per.drafted[k] += 1
            for k in range(ell):
                per.verified[k] += 1
            for k in range(n):
                per.accepted[k] += 1

    # ---- admission, emission, release ----
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
        sampling = SamplingBatch.from_params([r.params for r in new], logits.device)
        if bool(sampling.greedy.all()):
            first = logits.max(-1).indices  # == sampling_probs' one-hot (ties: lowest id)
        else:
            keys = torch.tensor([r.rng_key for r in new], dtype=torch.int64, device=logits.device)
            u = philox_uniforms(keys, torch.zeros_like(keys), 1, STREAM_FIRST)[:, 0]
            first = sample_inverse_cdf(sampling.probs(logits), u)
        if self.policy is not None:
            for r, tp in zip(new, taps):
                try:
                    self._parts()[0].start(r.slot, r.prompt, tp)
                except Exception:
                    self._fallback("start")
                    r.drafting = False
        for r, tok in zip(new, first.tolist()):
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
        self._deferred.drop(r.request_id)
        if self.policy is not None:
            try:
                self._parts()[0].release(r.slot)
            except Exception:
                self._fallback("release")
        if r.on_tokens and not r.notified:  # cancelled while active
            r.on_tokens(r.request_id, [], True, r.finish_reason)
