"""preprocessing: text_input -> input_ids with the target's tokenizer.json (docs/architecture.md §10).
An empty prompt is rejected here with INVALID_ARG naming `text_input`."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark import wiring
from dspark.runtime.text import encode, load_tokenizer


def target_path(model_config: dict) -> str:
    """The target's folder: the `model` parameter, DSPARK_MODEL overriding (dspark.wiring)."""
    return str(wiring.model_folder(wiring.resolve(wiring.pbtxt_params(model_config)).model))


def first_string(values: np.ndarray) -> str:
    """First element of a Triton STRING tensor (numpy object array of bytes) as text."""
    flat = values.reshape(-1)
    if flat.size == 0:
        return ""
    return flat[0].decode("utf-8", errors="replace") if isinstance(flat[0], bytes) else str(flat[0])


def invalid(message: str) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.tokenizer = load_tokenizer(target_path(json.loads(args["model_config"])))

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            text = first_string(pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy())
            if not text:
                responses.append(invalid("text_input must be a non-empty string"))
                continue
            ids = np.asarray(encode(self.tokenizer, text), dtype=np.int32)
            if ids.size == 0:
                responses.append(invalid("text_input encodes to zero tokens"))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
        return responses
