"""postprocessing: `dspark`'s responses -> the ensemble's outputs (docs/architecture.md §10).

The text arrives already detokenized: `dspark` keeps one incremental detokenizer per request
(it never splits a multi-byte character, and stop words must end generation in the decode loop,
which therefore needs the text anyway); a step here runs once per response, possibly batched
with other requests' responses, and keeps no per-request state.

Cancellation sensor. On tritonserver 2.51 a client that cancels a gRPC stream, dies, or closes
an HTTP generate_stream never makes `dspark`'s request look cancelled (its `is_cancelled()` stays
false, its sends succeed), but every request the ensemble makes to THIS model afterwards is
marked cancelled (measured: model_repository/README.md, "Cancellation"). So each response
carries `request_key`, and the first cancelled one is reported back to `dspark` with a BLS call
(`cancel_request_key`), which frees the slot at the next engine step. A heartbeat response
(key only, sent by `dspark` for non-streaming requests) produces no output, only the final flag.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.serving.request_format import OUTPUTS

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
REPORTED_KEYS = 4096  # keys already reported, remembered to report each once


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.reported: dict[int, None] = {}

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            key = int(pb_utils.get_input_tensor_by_name(request, "request_key").as_numpy().reshape(-1)[0])
            if request.is_cancelled():
                self._report(key)
                sender.send(flags=FINAL)
                continue
            outputs = [
                pb_utils.Tensor(name, t.as_numpy())
                for name in OUTPUTS
                if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None
            ]
            if not outputs:  # a heartbeat
                sender.send(flags=FINAL)
            else:
                sender.send(pb_utils.InferenceResponse(outputs), flags=FINAL)
        return None

    def _report(self, key: int) -> None:
        if key in self.reported:
            return
        self.reported[key] = None
        if len(self.reported) > REPORTED_KEYS:
            self.reported.pop(next(iter(self.reported)))
        call = pb_utils.InferenceRequest(
            model_name="dspark",
            requested_output_names=[],
            inputs=[pb_utils.Tensor("cancel_request_key", np.array([[key]], dtype=np.uint64))],
        )
        try:
            for _ in call.exec(decoupled=True):
                pass
        except Exception as e:  # the request then runs to its end; serving goes on
            pb_utils.Logger.log_warn(f"postprocessing: could not report cancelled request {key}: {e!r}")
