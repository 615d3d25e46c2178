"""The BLS stubs' forwarding (dspark.serving.stubs) through the calls `bls.RemoteModel` makes and
`bls.serve` answers, in one process: a small stand-in for the Python backend's `pb_utils`
(its documented Tensor / InferenceRequest / InferenceResponse calls, nothing else). The real
server runs the same code in tests/test_triton_smollm2.py."""

from __future__ import annotations

import numpy as np
import torch

from dspark.runtime.drafter.ngram import NGramDrafter
from dspark.runtime.sampling import SamplingParams
from dspark.serving import bls
from dspark.serving.stubs import DRAFTER_METHODS, DrafterServer, DrafterStub


class _Tensor:
    def __init__(self, name: str, value) -> None:
        self._name, self._value = name, value

    @classmethod
    def from_dlpack(cls, name: str, capsule) -> _Tensor:
        return cls(name, torch.utils.dlpack.from_dlpack(capsule).clone())

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value.numpy() if isinstance(self._value, torch.Tensor) else self._value

    def to_dlpack(self):
        if not isinstance(self._value, torch.Tensor):
            raise TypeError("a numpy tensor")
        return torch.utils.dlpack.to_dlpack(self._value)


class _Error:
    def __init__(self, message: str) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class _Response:
    def __init__(self, tensors=None, error=None) -> None:
        self._tensors, self._error = tensors or [], error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> _Error:
        return self._error

    def output_tensors(self) -> list:
        return self._tensors


class FakePbUtils:
    """Routes every InferenceRequest to `bls.serve` on one served object."""

    Tensor, InferenceResponse, TritonError = _Tensor, _Response, _Error

    def __init__(self, served, allowed) -> None:
        fake = self

        class Request:
            def __init__(self, model_name: str, inputs: list, requested_output_names: list) -> None:
                self._inputs = inputs

            def inputs(self) -> list:
                return self._inputs

            def exec(self) -> _Response:
                return bls.serve(fake, served, self, allowed)

        self.InferenceRequest = Request

    @staticmethod
    def get_input_tensor_by_name(request, name: str):
        return next(t for t in request.inputs() if t.name() == name)


class Lazy(NGramDrafter):
    """An n-gram drafter that says when its pending work is flushed."""

    flushes = 0

    def flush(self) -> None:
        Lazy.flushes += 1


def test_drafter_stub_forwards_flush_only_where_the_drafter_has_one():
    """A drafter with `flush` (the DSpark and hybrid drafters: pending context work) gets it
    through the stub, so the engine times a catch-up's flush apart from the next propose; one
    without has no `flush` on its stub either (the engine's getattr finds none), and the other
    calls go through as before."""
    lazy = DrafterStub(FakePbUtils(DrafterServer(Lazy(gamma=3)), DRAFTER_METHODS))
    assert lazy.gamma == 3 and callable(getattr(lazy, "flush", None))
    lazy.start(0, [1, 2, 3, 1, 2], torch.zeros(5, 4))
    lazy.flush()
    assert Lazy.flushes == 1
    block = lazy.propose([0], torch.tensor([3]), [SamplingParams()], torch.zeros(1, 3))
    assert block.tokens.shape == (1, 3)
    plain = DrafterStub(FakePbUtils(DrafterServer(NGramDrafter(gamma=3)), DRAFTER_METHODS))
    assert getattr(plain, "flush", None) is None
