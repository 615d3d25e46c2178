"""tensorrt_llm (CPU stand-in): TensorRT-LLM's `tensorrt_llm` tensor contract on our TargetEngine
(docs/architecture.md §10, §11; config.pbtxt says what is used). Each request carries a whole
sequence (`input_ids`) and optional `draft_input_ids`; like KV-cache reuse, it continues the
cached sequence sharing the longest prefix with it, and all requests of an execute run as ONE
ragged forward. Replies: greedy-accepted `output_ids` / `sequence_length` (TensorRT-LLM's output)
and `generation_logits` [1, ℓ+1, V] at the last input token and each draft."""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def first(request, name: str, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.enabled = (
            os.environ.get("DSPARK_TRTLLM_STANDIN") or params.get("enabled", "false")
        ).lower() in ("1", "true", "yes")
        if not self.enabled:
            return
        from dspark import wiring
        from dspark.serving.trtllm_standin import PrefixCachedTarget

        spec = wiring.resolve({k: v for k, v in params.items() if k in wiring.ENV_VARS})
        self.target = PrefixCachedTarget(wiring.load_target(spec))

    def execute(self, requests: list) -> list:
        if not self.enabled:
            error = pb_utils.TritonError(
                "the tensorrt_llm stand-in is disabled (parameter enabled, or DSPARK_TRTLLM_STANDIN=1)",
                pb_utils.TritonError.UNAVAILABLE,
            )
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        jobs, responses = [], [None] * len(requests)
        for i, request in enumerate(requests):
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)
            n = int(first(request, "input_lengths", ids.size))
            drafts = pb_utils.get_input_tensor_by_name(request, "draft_input_ids")
            drafts = [] if drafts is None else drafts.as_numpy().reshape(-1).tolist()
            if first(request, "beam_width", 1) != 1 or first(request, "streaming", False):
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(
                        "stand-in: beam_width 1 and streaming false only", pb_utils.TritonError.INVALID_ARG
                    )
                )
                continue
            jobs.append(
                (
                    i,
                    ids[:n].tolist(),
                    drafts,
                    bool(first(request, "return_generation_logits", False)),
                    bool(first(request, "exclude_input_in_output", False)),
                )
            )
        try:
            results = self.target.run([(ids, drafts) for _, ids, drafts, _, _ in jobs])
        except Exception as e:
            results = None
            for i, *_ in jobs:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"{type(e).__name__}: {e}")
                )
        for (i, ids, _, want_logits, exclude), result in zip(jobs, results or []):
            accepted, logits = result
            out = accepted if exclude else ids + accepted
            tensors = [
                pb_utils.Tensor("output_ids", np.asarray([out], dtype=np.int32)),
                pb_utils.Tensor("sequence_length", np.asarray([len(out)], dtype=np.int32)),
            ]
            if want_logits:
                tensors.append(pb_utils.Tensor("generation_logits", logits.float().numpy()[None, None]))
            responses[i] = pb_utils.InferenceResponse(tensors)
        return responses

    def finalize(self) -> None:
        if self.enabled:
            from dspark.serving import bls

            bls.exit_fast_at_shutdown()
