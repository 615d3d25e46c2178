"""target: the verifier behind BLS (docs/architecture.md §10). The `dspark` model's
`dspark.serving.stubs.TargetStub` forwards `TargetLike` calls here; this model runs them on an
in-process `TargetEngine` built by dspark.wiring from this config's parameters."""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from dspark import wiring
from dspark.serving import bls
from dspark.serving.stubs import TARGET_METHODS, TargetServer


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        spec = wiring.resolve(wiring.pbtxt_params(json.loads(args["model_config"])))
        self.server = TargetServer(wiring.load_target(spec), str(wiring.model_folder(spec.model)))

    def execute(self, requests: list) -> list:
        return [bls.serve(pb_utils, self.server, request, TARGET_METHODS) for request in requests]

    def finalize(self) -> None:
        bls.exit_fast_at_shutdown()
