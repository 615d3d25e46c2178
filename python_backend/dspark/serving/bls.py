"""One generic forwarding mechanism for the engine's contracts over Triton BLS (architecture §10).

The `dspark` model calls methods of `TargetLike` / `DrafterLike` objects that live in the
`target` / `drafter` models. A call travels as one `pb_utils.InferenceRequest`:
  - `call`     STRING [1]: JSON {"method", "args"}, tensors replaced by references (only
    methods the serving side allows are run),
  - tensors    by argument (or dataclass field) name, e.g. `taps`, `tokens`, `positions`;
    a list of tensors travels as one tensor (concatenated along dim 0) plus `<name>_lengths`.
The reply carries `result` (JSON) and tensors `out_0`, `out_1`, ... referenced from it.
Tensors go through DLPack (bf16 included), so nothing is converted on the way.

`encode_call` / `decode_call` / `encode_result` / `decode_result` are plain Python (tested
without Triton); `RemoteModel` and `serve` are the two ends inside the Python backend.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.interfaces import DraftBlock
from dspark.runtime.sampling import SamplingParams

# Dataclasses that may cross (by name): nothing else is ever instantiated from a message.
DATACLASSES: dict[str, type] = {
    "RaggedBatch": RaggedBatch,
    "DraftBlock": DraftBlock,
    "SamplingParams": SamplingParams,
}
MAX_OUTPUTS = 4  # out_0 .. out_3 (+ out_i_lengths): declared in the models' config.pbtxt


class RemoteError(RuntimeError):
    """The remote model answered with an error (its message is kept)."""


class _Packer:
    """Replaces tensors by references while building JSON; collects them by name."""

    def __init__(self, names: Iterable[str] | None = None):
        self.tensors: dict[str, torch.Tensor] = {}
        self._names = iter(names) if names is not None else None

    def _name(self, preferred: str) -> str:
        name = next(self._names) if self._names is not None else preferred
        if name in self.tensors:
            raise ValueError(f"tensor name {name!r} used twice in one call")
        return name

    def pack(self, value: Any, name: str = "value") -> Any:
        if isinstance(value, torch.Tensor):
            key = self._name(name)
            self.tensors[key] = value.contiguous()
            return {"$t": key}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value).__name__
            if cls not in DATACLASSES:
                raise TypeError(f"cannot send a {cls}")
            return {
                "$dc": cls,
                "fields": {
                    f.name: self.pack(getattr(value, f.name), f.name) for f in dataclasses.fields(value)
                },
            }
        if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            key = self._name(name)
            lengths = [int(v.shape[0]) for v in value]
            self.tensors[key] = torch.cat([v.contiguous() for v in value]) if value else torch.empty(0)
            self.tensors[key + "_lengths"] = torch.tensor(lengths, dtype=torch.int64)
            return {"$tl": key}
        if isinstance(value, dict):
            return {"$dict": {str(k): self.pack(v, f"{name}_{k}") for k, v in value.items()}}
        if isinstance(value, tuple):
            return {"$tuple": [self.pack(v, f"{name}_{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.pack(v, f"{name}_{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot send a {type(value).__name__} ({name})")


def _unpack(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_unpack(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if "$t" in node:
        return tensors[node["$t"]]
    if "$tl" in node:
        flat, lengths = tensors[node["$tl"]], tensors[node["$tl"] + "_lengths"].tolist()
        return list(flat.split(lengths)) if lengths else []
    if "$dict" in node:
        return {k: _unpack(v, tensors) for k, v in node["$dict"].items()}
    if "$tuple" in node:
        return tuple(_unpack(v, tensors) for v in node["$tuple"])
    if "$dc" in node:
        cls = DATACLASSES.get(node["$dc"])
        if cls is None:
            raise TypeError(f"refusing to build a {node['$dc']}")
        return cls(**{k: _unpack(v, tensors) for k, v in node["fields"].items()})
    raise ValueError(f"malformed message node {node!r}")


def encode_call(method: str, args: tuple, arg_names: list[str]) -> tuple[str, dict[str, torch.Tensor]]:
    """-> (JSON of {"method", "args"}, tensors by name). Tensors are named after their argument."""
    packer = _Packer()
    packed = [packer.pack(a, n) for a, n in zip(args, arg_names)]
    return json.dumps({"method": method, "args": packed}), packer.tensors


def decode_call(message: str, tensors: dict[str, torch.Tensor]) -> tuple[str, list]:
    d = json.loads(message)
    return d["method"], [_unpack(a, tensors) for a in d["args"]]


def encode_result(value: Any) -> tuple[str, dict[str, torch.Tensor]]:
    names = [f"out_{i}" for i in range(MAX_OUTPUTS)]
    packer = _Packer(names)
    return json.dumps(packer.pack(value)), packer.tensors


def decode_result(message: str, tensors: dict[str, torch.Tensor]) -> Any:
    return _unpack(json.loads(message), tensors)


# ---- the two ends inside the Python backend (pb_utils exists only there) ----


def _to_pb(pb_utils, name: str, t: torch.Tensor):
    if t.numel() == 0:  # DLPack of an empty tensor is not portable: send it as numpy
        return pb_utils.Tensor(name, t.to(torch.float32 if t.dtype == torch.bfloat16 else t.dtype).numpy())
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t.detach().cpu()))


def _from_pb(t) -> torch.Tensor:
    try:
        return torch.utils.dlpack.from_dlpack(t.to_dlpack())
    except Exception:  # empty tensors (see _to_pb)
        return torch.from_numpy(np.array(t.as_numpy()))


def _string(pb_utils, name: str, text: str):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class RemoteModel:
    """Calls methods of the object a Triton model serves with `serve`."""

    def __init__(self, pb_utils, model_name: str, tensor_names: Iterable[str], output_names: Iterable[str]):
        """tensor_names / output_names: the inputs / outputs the model declares (config.pbtxt)."""
        self.pb_utils, self.model_name = pb_utils, model_name
        self.output_names = list(output_names)
        self.tensor_names = set(tensor_names)

    def call(self, method: str, *args: Any, arg_names: list[str]) -> Any:
        message, tensors = encode_call(method, args, arg_names)
        unknown = set(tensors) - self.tensor_names
        if unknown:
            raise ValueError(f"{self.model_name} declares no input {sorted(unknown)}")
        pb = self.pb_utils
        # Triton checks request inputs against config.pbtxt, which declares float inputs FP32
        # (one config serves fp32 and bf16 targets): a bf16 tensor (taps of a bf16 target) goes
        # as fp32 and the receiving model casts it to its own dtype. Outputs are not checked.
        tensors = {n: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
                   for n, t in tensors.items()}
        inputs = [_string(pb, "call", message)] + [_to_pb(pb, n, t) for n, t in tensors.items()]
        response = pb.InferenceRequest(
            model_name=self.model_name, inputs=inputs, requested_output_names=self.output_names
        ).exec()
        if response.has_error():
            raise RemoteError(f"{self.model_name}.{method}: {response.error().message()}")
        outs = {t.name(): t for t in response.output_tensors()}
        result = outs.pop("result").as_numpy().reshape(-1)[0].decode("utf-8")
        return decode_result(result, {name: _from_pb(t) for name, t in outs.items()})


def serve(pb_utils, obj: Any, request, allowed: Iterable[str]):
    """Run one forwarded call on `obj`; -> the InferenceResponse (errors become error responses)."""
    try:
        call = pb_utils.get_input_tensor_by_name(request, "call").as_numpy().reshape(-1)[0].decode("utf-8")
        # copies that own their memory: a served object may keep an argument past the call (the
        # DSpark drafter runs an extend with its next propose), and a request's input tensors are
        # views of memory the backend owns only until the request is answered
        tensors = {t.name(): _from_pb(t).clone() for t in request.inputs() if t.name() != "call"}
        method, args = decode_call(call, tensors)
        if method not in allowed:
            raise ValueError(f"method {method!r} is not served (allowed: {', '.join(sorted(allowed))})")
        message, outs = encode_result(getattr(obj, method)(*args))
        tensors_out = [_string(pb_utils, "result", message)] + [
            _to_pb(pb_utils, n, t) for n, t in outs.items()
        ]
        return pb_utils.InferenceResponse(tensors_out)
    except Exception as e:  # the caller raises RemoteError with this message
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))


def exit_fast_at_shutdown() -> None:
    """Call from a model's `finalize`: once the stub has finished its own shutdown, end the
    process without the interpreter's teardown of torch (measured: a server stop went from 8.7 s
    to 3.1 s, most of it these stubs' exits). Nothing is left to flush at that point."""
    import atexit
    import os

    atexit.register(os._exit, 0)
