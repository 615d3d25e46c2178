"""dspark: the decoupled decoding model (docs/architecture.md §10).

`execute` only validates and hands requests to the ONE engine loop (`dspark.runtime.engine.SpecEngine`
over the in-process `TargetEngine` and an optional drafter), which a background thread
steps with continuous batching: a request arriving mid-generation joins at the next step.
This file is parsing, validation and the per-request token callback; the loop is the library's.

Per request it keeps a `dspark.runtime.text.TextStream` (incremental detokenizer + stop strings;
see postprocessing/1/model.py for why the text is made here). Streaming requests get one
response per new piece of text and the final flag on the last; non-streaming requests get
one response with the whole text. A stop string cancels the request in the engine (its
slot frees at the next step). Every accepted request gets exactly one final response: on
success, error, cancellation or shutdown. Engine counters go to the metrics port
(`dspark.serving.triton_metrics`).
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark import wiring
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.text import TextStream
from dspark.serving.triton_metrics import TritonEngineMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_TOKENS = 8  # ask the server whether the client cancelled every this many tokens (one IPC)
METRICS_INTERVAL_S = 0.5


@dataclass
class Job:
    sender: object  # pb_utils.InferenceResponseSender
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stream: bool
    text: TextStream
    generated: int = 0
    next_cancel_check: int = CANCEL_CHECK_TOKENS
    done: bool = False  # the final response has been sent


def optional_input(request, name: str):
    """First element of an optional input tensor, or None when the client left it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    return values[0].item() if values.size else None


def error_response(message: str, code: int | None = None) -> pb_utils.InferenceResponse:
    """An error response; code defaults to INVALID_ARG (pb_utils.TritonError exists only at run time)."""
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        spec = wiring.resolve(wiring.pbtxt_params(config))
        self.target = wiring.load_target(spec)
        self.max_seq_len = spec.max_seq_len
        if self.target.tokenizer is None:
            raise RuntimeError(f"model {spec.model} has no tokenizer.json")
        self.eos = set(self.target.eos_token_ids)
        self.engine = wiring.build_engine(spec, target=self.target)
        self.jobs: dict[str, Job] = {}  # request id -> job, until its final response
        self.ids = itertools.count()
        self.last_error = ""
        self.metrics = TritonEngineMetrics(pb_utils, self.engine.gamma)
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._serve_forever, name="dspark-engine", daemon=True)
        self.metrics_thread = threading.Thread(target=self._export_metrics, name="dspark-metrics",
                                               daemon=True)
        self.worker.start()
        self.metrics_thread.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(self._parse(request, sender))
            except ValueError as e:
                sender.send(error_response(str(e)), flags=FINAL)
            except Exception as e:  # every request gets its final response, whatever happens
                sender.send(error_response(f"bad request: {e!r}", pb_utils.TritonError.INTERNAL), flags=FINAL)
        return None

    def finalize(self) -> None:
        self.stopping.set()
        self.worker.join(timeout=60)
        self.metrics_thread.join(timeout=10)
        if not self.worker.is_alive():  # the loop has returned: finishing the rest here is safe
            self.last_error = "server is shutting down"
            self.engine.abort("shutdown")
        self.metrics.close()

    # --- request parsing: ValueError messages name the offending input ---
    def _parse(self, request, sender) -> Job:
        prompt = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1).tolist()
        if not prompt:
            raise ValueError("input_ids must be non-empty")
        vocab = self.target.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        max_tokens = optional_input(request, "max_tokens")
        if max_tokens is None or max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise ValueError(f"text_input is {len(prompt)} tokens; at most {self.max_seq_len - 1} fit")
        if max_tokens > room:
            raise ValueError(
                f"max_tokens {max_tokens} exceeds the {room} tokens left after the "
                f"{len(prompt)}-token prompt (max_seq_len {self.max_seq_len})"
            )
        temperature, top_p = optional_input(request, "temperature"), optional_input(request, "top_p")
        top_k, seed = optional_input(request, "top_k"), optional_input(request, "seed")
        params = SamplingParams(  # raises ValueError naming temperature / top_k / top_p
            temperature=0.0 if temperature is None else float(temperature),
            top_k=0 if top_k is None else int(top_k),
            top_p=1.0 if top_p is None else float(top_p),
            seed=None if seed is None else int(seed),
        )
        stop_tensor = pb_utils.get_input_tensor_by_name(request, "stop")
        stop_values = [] if stop_tensor is None else stop_tensor.as_numpy().reshape(-1).tolist()
        stops = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in stop_values]
        stream = bool(optional_input(request, "stream") or False)
        text = TextStream(self.target.tokenizer, prompt, stops)
        return Job(sender, [int(t) for t in prompt], int(max_tokens), params, stream, text)

    def _submit(self, job: Job) -> None:
        request_id = f"triton-{next(self.ids)}"
        self.jobs[request_id] = job
        try:  # stop strings stay with the TextStream (it also holds back partial matches)
            self.engine.add_request(job.prompt, job.max_tokens, job.params, request_id=request_id,
                                    stop_token_ids=sorted(self.eos), on_tokens=self._on_tokens)
        except Exception:
            del self.jobs[request_id]
            raise

    # --- background threads ---
    def _serve_forever(self) -> None:
        """The engine loop; a step that raises fails every pending request (one final error
        response each, via abort -> _on_tokens) and the loop carries on serving."""
        while not self.stopping.is_set():
            try:
                self.engine.run_forever(self.stopping)
            except Exception as e:
                self.last_error = f"generation failed: {e!r}"
                try:
                    self.engine.abort("error")
                except Exception:  # abort could not reach every request: answer them here
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
            self.jobs.pop(request_id, None)
            return
        if reason in ("error", "shutdown"):
            code = pb_utils.TritonError.INTERNAL if reason == "error" else pb_utils.TritonError.UNAVAILABLE
            self._send(request_id, error_response(self.last_error or reason, code), FINAL)
            return
        job.generated += len(new_ids)
        if job.generated >= job.next_cancel_check:
            job.next_cancel_check = job.generated + CANCEL_CHECK_TOKENS
            if job.sender.is_cancelled():
                self.engine.cancel(request_id)
                self._send(request_id, None, FINAL)
                return
        delta = job.text.push([t for t in new_ids if t not in self.eos])
        if job.text.stopped and not finished:
            self.engine.cancel(request_id)  # frees the slot at the next step boundary
        if job.text.stopped or finished:
            delta += job.text.finish()
            self._send(request_id, delta if job.stream else job.text.text, FINAL)
        elif job.stream and delta:
            self._send(request_id, delta)

    def _send(self, request_id: str, payload, flags: int = 0) -> None:
        """payload: text (a response with text_delta), an error response, or None (bare final flag)."""
        job = self.jobs[request_id]
        if flags & FINAL:
            job.done = True
            del self.jobs[request_id]
        if isinstance(payload, str):
            text = np.array([payload.encode("utf-8")], dtype=np.object_)
            payload = pb_utils.InferenceResponse([pb_utils.Tensor("text_delta", text)])
        try:
            if payload is None:
                job.sender.send(flags=flags)
            else:
                job.sender.send(payload, flags=flags)
        except Exception:  # the client is gone; nothing more can reach it
            if not job.done:
                job.done = True
                self.engine.cancel(request_id)
                self.jobs.pop(request_id, None)
