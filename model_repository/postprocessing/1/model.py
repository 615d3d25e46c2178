"""postprocessing: text_delta -> text_output, once per response `dspark` streams.

Why the detokenization happens in `dspark` and not here: in an ensemble this model runs
once per streamed response, possibly batched with other requests' responses, with no
per-request identity, so it cannot own a per-request detokenizer state. And stop strings
must end generation (and free the KV slot) in the decode loop, which therefore needs the
text anyway. So `dspark` keeps one `dspark.runtime.text.TextStream` per request (never splits a
multi-byte character, holds back a possible partial stop string) and sends text deltas;
this step stays stateless and only shapes the public output. It is the place for output
formatting that does not need request state.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            delta = pb_utils.get_input_tensor_by_name(request, "text_delta").as_numpy()
            text = np.asarray(delta, dtype=np.object_).reshape(-1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
