"""preprocessing: validate a request in TensorRT-LLM's ensemble format and tokenize text_input
(docs/architecture.md §10). Every field is checked here (dspark.serving.request_format):
a bad or unsupported one -> INVALID_ARG naming it, before `dspark` sees the request.
text_input is size-checked before it reaches the tokenizer."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark import wiring
from dspark.runtime.text import encode, load_tokenizer
from dspark.serving import bls
from dspark.serving.request_format import INPUTS, Limits, RequestError, check_prompt_length, parse


def invalid(message: str) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        spec = wiring.resolve(wiring.pbtxt_params(json.loads(args["model_config"])))
        self.tokenizer = load_tokenizer(wiring.model_folder(spec.model))
        self.limits = Limits(spec.max_seq_len, self.tokenizer.get_vocab_size(with_added_tokens=True))

    def execute(self, requests: list) -> list:
        return [self._one(request) for request in requests]

    def _one(self, request) -> pb_utils.InferenceResponse:
        tensors = {
            name: t.as_numpy()
            for name in INPUTS
            if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None
        }
        try:
            batch = tensors["text_input"].shape[0] if tensors.get("text_input") is not None else 1
            if batch != 1:
                raise RequestError("text_input", f"a batch of {batch} prompts: send one request per prompt")
            req = parse(tensors.get, self.limits)
            req.prompt_ids = encode(self.tokenizer, req.text)
            check_prompt_length(req, self.limits)
        except RequestError as e:
            return invalid(str(e))
        ids = np.asarray(req.prompt_ids, dtype=np.int32)[None, :]
        return pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)])

    def finalize(self) -> None:
        bls.exit_fast_at_shutdown()
