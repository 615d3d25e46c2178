"""drafter: the drafter behind BLS (docs/architecture.md §10). The `dspark` model's
`dspark.serving.stubs.DrafterStub` forwards every `DrafterLike` call here; this model runs
it on the drafter dspark.wiring builds from this config (drafter `none`: nothing is loaded,
`describe` says gamma 0 and `dspark` decodes plain without calling this model)."""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from dspark import wiring
from dspark.serving import bls
from dspark.serving.stubs import DRAFTER_METHODS, DrafterServer


class Disabled:
    gamma = 0
    sts_temperatures: list[float] = []


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        spec = wiring.resolve(wiring.pbtxt_params(json.loads(args["model_config"])))
        drafter = None
        if spec.drafter != "none":
            target = wiring.load_shared_weights(spec) if wiring.needs_weights(spec.drafter) else None
            drafter = wiring.load_drafter(spec, target)
        self.server = DrafterServer(drafter if drafter is not None else Disabled())

    def execute(self, requests: list) -> list:
        return [bls.serve(pb_utils, self.server, request, DRAFTER_METHODS) for request in requests]

    def finalize(self) -> None:
        bls.exit_fast_at_shutdown()
