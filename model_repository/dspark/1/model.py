"""dspark: the BLS scheduler (docs/architecture.md §10), decoupled.

`execute` validates a request (TensorRT-LLM's ensemble format, `dspark.serving.request_format`)
and hands it to the ONE engine loop, `dspark.runtime.engine.SpecEngine` built by dspark.wiring,
which a background thread steps with continuous batching. The engine's target and drafter are
BLS stubs (`dspark.serving.stubs`) that call the `target` and `drafter` models.

Two ways in:
- from the `ensemble` (preprocessing has tokenized: `input_ids` is set). Responses carry
  `request_key`, which `postprocessing` uses to report a cancelled client back here
  (`cancel_request_key`): tritonserver 2.51 never marks this step's request cancelled, but it
  does mark postprocessing's (model_repository/README.md, "Cancellation"). Non-streaming
  requests get a heartbeat response (key only, swallowed by postprocessing) at most every
  `cancel_check_ms` so that a cancel is noticed while they run.
- directly, like TensorRT-LLM's `tensorrt_llm_bls` (same inputs, `text_input` tokenized here):
  the response sender's `is_cancelled()` is polled once per engine step.

Per request a `dspark.runtime.text.TextStream` makes the text (incremental detokenizer, never
splits a character; stop words end the request in the engine, freeing its slot). Every
accepted request gets exactly one final response: on success, error, cancellation or shutdown.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from dspark import wiring
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.text import TextStream, encode, load_tokenizer
from dspark.serving import bls
from dspark.serving.request_format import GenerationRequest, Limits, RequestError, check_prompt_length, parse
from dspark.serving.stubs import DrafterStub, TargetStub
from dspark.serving.triton_metrics import TritonEngineMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_INTERVAL_S = 0.5
CONNECT_TIMEOUT_S = 900.0  # waiting for the target / drafter models to load


@dataclass
class Job:
    sender: object  # pb_utils.InferenceResponseSender
    key: int
    req: GenerationRequest
    text: TextStream
    via_ensemble: bool
    stop_ids: frozenset
    arrival_ns: int = field(default_factory=time.time_ns)
    scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    last_heartbeat: float = 0.0
    generated: int = 0
    sent_tokens: int = 0  # tokens already reported in streamed responses (num_output_tokens per chunk)
    client_cancelled: bool = False
    done: bool = False  # the final response has been sent
    engine_request: object = None  # dspark.runtime.engine.Request once added


def optional_input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def error_response(message: str, code=None) -> pb_utils.InferenceResponse:
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def own_params(config: dict) -> tuple[dict, dict]:
    """(engine settings for dspark.wiring, this model's own parameters)."""
    params = wiring.pbtxt_params(config)
    return (
        {k: v for k, v in params.items() if k in wiring.ENV_VARS},
        {k: v for k, v in params.items() if k not in wiring.ENV_VARS},
    )


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        # The forwards run in the target / drafter processes; this one only samples and accepts
        # (small tensors): one thread, so it does not contend with them for the cores.
        torch.set_num_threads(1)
        spec_params, own = own_params(json.loads(args["model_config"]))
        self.spec = wiring.resolve(spec_params)
        self.target_model = os.environ.get("DSPARK_TARGET_MODEL") or own.get("target_model", "target")
        self.drafter_model = own.get("drafter_model", "drafter")
        self.cancel_check_s = float(own.get("cancel_check_ms", "100")) / 1000
        self.model_folder = wiring.model_folder(self.spec.model)
        self.tokenizer = load_tokenizer(self.model_folder)
        self.limits = Limits(self.spec.max_seq_len, self.tokenizer.get_vocab_size(with_added_tokens=True))
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()  # guards jobs and backlog (execute thread vs engine thread)
        self.backlog: list[Job] = []  # accepted before the engine was connected
        self.keys = itertools.count(1)
        self.engine = None
        self.metrics = None
        self.last_error = ""
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.metrics_thread = threading.Thread(
            target=self._export_metrics, name="dspark-metrics", daemon=True
        )

    def execute(self, requests: list) -> None:
        if not self.worker.is_alive() and self.engine is None and not self.stopping.is_set():
            # Started by the first request, not by initialize: on tritonserver 2.51 a thread that
            # talks to the server (BLS, is_model_ready) while the model still loads aborts it
            # (boost::interprocess::lock_exception, measured).
            self.worker.start()
        for request in requests:
            sender = request.get_response_sender()
            cancel = optional_input(request, "cancel_request_key")
            if cancel is not None:  # postprocessing: this key's client is gone
                self._client_gone(str(int(cancel.reshape(-1)[0])))
                sender.send(flags=FINAL)
                continue
            try:
                self._submit(self._parse(request, sender))
            except RequestError as e:
                sender.send(error_response(str(e)), flags=FINAL)
            except Exception as e:  # every request gets its final response, whatever happens
                sender.send(error_response(f"bad request: {e!r}", pb_utils.TritonError.INTERNAL), flags=FINAL)
        return None

    def finalize(self) -> None:
        self.stopping.set()
        self.worker.join(timeout=60)
        if self.metrics_thread.is_alive():
            self.metrics_thread.join(timeout=10)
        if self.engine is not None and not self.worker.is_alive():
            self.last_error = "server is shutting down"
            self.engine.abort("shutdown")
        for job in self._take_backlog():
            self._send(
                job, error_response("server is shutting down", pb_utils.TritonError.UNAVAILABLE), FINAL
            )
        if self.metrics is not None:
            self.metrics.close()
        bls.exit_fast_at_shutdown()

    # --- requests ---
    def _parse(self, request, sender) -> Job:
        def get(name: str):
            values = optional_input(request, name)
            if values is not None and values.ndim >= 1 and values.shape[0] > 1 and name == "text_input":
                raise RequestError(
                    "text_input", f"a batch of {values.shape[0]} prompts: send one request each"
                )
            return values

        req = parse(get, self.limits)
        ids = optional_input(request, "input_ids")
        via_ensemble = ids is not None
        req.prompt_ids = (
            ids.reshape(-1).astype(np.int64).tolist() if via_ensemble else encode(self.tokenizer, req.text)
        )
        check_prompt_length(req, self.limits)
        if via_ensemble and not 0 <= min(req.prompt_ids) <= max(req.prompt_ids) < self.limits.vocab_size:
            raise RequestError("input_ids", f"token ids must be in [0, {self.limits.vocab_size})")
        text = TextStream(self.tokenizer, req.prompt_ids, req.stop_words)
        return Job(sender, next(self.keys), req, text, via_ensemble, frozenset())

    def _submit(self, job: Job) -> None:
        with self.lock:
            self.jobs[str(job.key)] = job
            if self.engine is None:
                self.backlog.append(job)
                return
        self._add_to_engine(job)

    def _add_to_engine(self, job: Job) -> None:
        r = job.req  # end_id replaces the model's end tokens, as in TensorRT-LLM
        job.stop_ids = frozenset([r.end_id] if r.end_id is not None else self.engine.target.eos_token_ids)
        params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed)
        job.scheduled_ns = time.time_ns()
        try:
            job.engine_request = self.engine.add_request(
                r.prompt_ids,
                r.max_tokens,
                params,
                request_id=str(job.key),
                stop_token_ids=sorted(job.stop_ids),
                on_tokens=self._on_tokens,
            )
        except Exception as e:
            self._send(job, error_response(str(e)), FINAL)

    def _take_backlog(self) -> list[Job]:
        with self.lock:
            jobs, self.backlog = self.backlog, []
        return jobs

    def _client_gone(self, request_id: str) -> None:
        with self.lock:
            job = self.jobs.get(request_id)
        if job is not None and not job.done and not job.client_cancelled:
            job.client_cancelled = True
            if self.engine is not None:
                self.engine.cancel(request_id)  # the slot frees at the next step boundary

    # --- background threads ---
    def _connect(self):
        """Stubs for the target and drafter models, waiting for them to load."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        models = [m for m in (self.target_model, self.drafter_model) if m]
        while True:
            try:  # a BLS call to a model that is still loading can crash tritonserver 2.51: ask first
                if not all(pb_utils.is_model_ready(model_name=m) for m in models):
                    raise RuntimeError("not loaded yet")
                target = self._target_stub()
                drafter = DrafterStub(pb_utils, self.drafter_model) if self.drafter_model else None
                break
            except Exception as e:
                waited = CONNECT_TIMEOUT_S - (deadline - time.monotonic())
                if waited > 30:
                    pb_utils.Logger.log_warn(
                        f"dspark: waiting for {self.target_model}/{self.drafter_model}: {e!r}"
                    )
                if self.stopping.is_set() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"cannot reach the {self.target_model}/{self.drafter_model} models: {e}"
                    ) from e
                time.sleep(0.5)
        folder = target.info.get("model_folder")
        if folder and str(folder) != str(self.model_folder):
            raise RuntimeError(
                f"the target serves {folder} but dspark tokenizes for {self.model_folder}: "
                "set the same `model` in both config.pbtxt files"
            )
        if drafter is not None and drafter.gamma < 1:  # the drafter model is configured off
            drafter = None
        self.limits.max_seq_len = min(self.limits.max_seq_len, target.max_seq_len)
        return target, drafter

    def _target_stub(self):
        """The target model's `TargetLike`: our `target` contract, or TensorRT-LLM's (no taps)."""
        if self.target_model != "tensorrt_llm":
            return TargetStub(pb_utils, self.target_model)
        from dspark.serving.trtllm_standin import TrtllmTargetClient

        def send(fields: dict) -> torch.Tensor:
            inputs = [pb_utils.Tensor(name, value) for name, value in fields.items()]
            response = pb_utils.InferenceRequest(
                model_name=self.target_model, inputs=inputs, requested_output_names=["generation_logits"]
            ).exec()
            if response.has_error():
                raise RuntimeError(f"{self.target_model}: {response.error().message()}")
            logits = pb_utils.get_output_tensor_by_name(response, "generation_logits").as_numpy()
            return torch.from_numpy(np.array(logits.reshape(-1, logits.shape[-1])))

        return TrtllmTargetClient(send, self.model_folder, self.spec.capacity, self.spec.max_seq_len)

    def _run(self) -> None:
        try:
            target, drafter = self._connect()
            engine = wiring.build_engine(self.spec, target=target, drafter=drafter)
        except Exception as e:
            pb_utils.Logger.log_error(f"dspark: engine not built: {e!r}")
            self.last_error = f"engine not available: {e}"
            for job in self._take_backlog():
                self._send(job, error_response(self.last_error, pb_utils.TritonError.UNAVAILABLE), FINAL)
            return
        pb_utils.Logger.log_info(
            f"dspark: engine ready (target {self.target_model}, drafter "
            f"{type(drafter).__name__ if drafter else 'none'}, policy {engine.policy and engine.policy.name})"
        )
        self.metrics = TritonEngineMetrics(pb_utils, engine.gamma)
        with self.lock:
            self.engine = engine
        for job in self._take_backlog():
            self._add_to_engine(job)
        self.metrics_thread.start()
        while not self.stopping.is_set():
            try:
                engine.run_forever(self.stopping)
            except Exception as e:  # a step raised: fail every pending request once, keep serving
                self.last_error = f"generation failed: {e!r}"
                try:
                    engine.abort("error")
                except Exception:
                    for request_id in list(self.jobs):
                        self._on_tokens(request_id, [], True, "error")

    def _export_metrics(self) -> None:
        while not self.stopping.wait(METRICS_INTERVAL_S):
            self._update_metrics()
        self._update_metrics()

    def _update_metrics(self) -> None:
        try:
            self.metrics.update(self.engine.metrics, self.engine.num_active, len(self.jobs))
        except Exception as e:  # metrics must never take serving down
            pb_utils.Logger.log_warn(f"dspark metrics update failed: {e!r}")

    # --- the engine callback (engine thread) ---
    def _on_tokens(self, request_id: str, new_ids: list[int], finished: bool, reason: str | None) -> None:
        job = self.jobs.get(request_id)
        if job is None or job.done:
            return
        now = time.time_ns()
        if new_ids:
            job.first_token_ns = job.first_token_ns or now
            job.last_token_ns = now
            job.generated += len(new_ids)
        if reason in ("error", "shutdown"):
            code = pb_utils.TritonError.INTERNAL if reason == "error" else pb_utils.TritonError.UNAVAILABLE
            self._send(job, error_response(self.last_error or reason, code), FINAL, reason)
            return
        if not finished and not job.via_ensemble and not job.client_cancelled and job.sender.is_cancelled():
            job.client_cancelled = True
            self.engine.cancel(request_id)
        if job.client_cancelled:
            if finished:
                self._send(job, None, FINAL, "cancelled")
            return
        delta = job.text.push([t for t in new_ids if t not in job.stop_ids])
        if job.text.stopped and not finished:
            self.engine.cancel(request_id)  # a stop word: the slot frees at the next step boundary
        if job.text.stopped or finished:
            delta += job.text.finish()
            text = (
                delta if job.req.stream else (("" if job.req.exclude_input else job.req.text) + job.text.text)
            )
            self._send(job, text, FINAL, "stop" if job.text.stopped or reason == "cancelled" else reason)
        elif job.req.stream and delta:
            self._send(job, delta)
        elif job.via_ensemble and time.monotonic() - job.last_heartbeat >= self.cancel_check_s:
            job.last_heartbeat = time.monotonic()
            self._send(job, None, heartbeat=True)

    def _outputs(self, job: Job, text: str | None, final: bool) -> list:
        r, out = job.req, []
        if text is not None:
            out.append(pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)))
        if job.via_ensemble:
            out.append(pb_utils.Tensor("request_key", np.array([[job.key]], dtype=np.uint64)))
        if text is None:
            return out
        if r.return_num_input_tokens:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([[len(r.prompt_ids)]], dtype=np.int32)))
        if r.return_num_output_tokens:  # streaming: the tokens of this response; else all of them
            n = job.generated - job.sent_tokens if r.stream else job.generated
            job.sent_tokens = job.generated
            out.append(pb_utils.Tensor("num_output_tokens", np.array([[n]], dtype=np.int32)))
        if r.return_perf_metrics:
            request = self._request_stats(job)
            for name, value, dtype in (
                ("arrival_time_ns", job.arrival_ns, np.int64),
                ("first_scheduled_time_ns", job.scheduled_ns, np.int64),
                ("first_token_time_ns", job.first_token_ns, np.int64),
                ("last_token_time_ns", job.last_token_ns, np.int64),
                ("acceptance_rate", request[0], np.float32),
                ("total_accepted_draft_tokens", request[1], np.int32),
                ("total_draft_tokens", request[2], np.int32),
            ):
                out.append(pb_utils.Tensor(name, np.array([[value]], dtype=dtype)))
        return out

    def _request_stats(self, job: Job) -> tuple[float, int, int]:
        """(acceptance rate, accepted drafts, verified drafts) of the job's engine request."""
        req = job.engine_request
        if req is None:
            return 0.0, 0, 0
        accepted, verified = sum(req.accepted), sum(req.verified)
        return (accepted / verified if verified else 0.0), accepted, verified

    def _send(
        self, job: Job, payload, flags: int = 0, reason: str | None = None, heartbeat: bool = False
    ) -> None:
        """payload: text (a response), an error response, or None (heartbeat, or a bare final flag)."""
        final = bool(flags & FINAL)
        if final:
            with self.lock:
                if job.done:
                    return
                job.done = True
                self.jobs.pop(str(job.key), None)
        if isinstance(payload, str) or heartbeat:
            payload = pb_utils.InferenceResponse(
                self._outputs(job, payload if isinstance(payload, str) else None, final)
            )
        try:
            if payload is None:
                job.sender.send(flags=flags)
            else:
                job.sender.send(payload, flags=flags)
        except Exception:  # the client is gone; nothing more can reach it
            if not final:
                job.client_cancelled = True
                self.engine.cancel(str(job.key))
        if final and self.metrics is not None:
            now = time.time_ns()
            ttft = (job.first_token_ns - job.arrival_ns) / 1e9 if job.first_token_ns else None
            itl = (
                (job.last_token_ns - job.first_token_ns) / 1e9 / (job.generated - 1)
                if job.generated > 1
                else None
            )
            self.metrics.observe_request(
                reason or "error",
                ttft,
                itl,
                (now - job.arrival_ns) / 1e9,
                client_cancelled=job.client_cancelled,
            )
