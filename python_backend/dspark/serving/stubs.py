"""The engine's contracts across Triton models (architecture §2, §10): one loop, two transports.

Serving side (inside the `target` / `drafter` models): `TargetServer` and `DrafterServer` wrap
the in-process objects and say which methods may be called remotely.
Calling side (inside the `dspark` BLS model): `TargetStub` implements `TargetLike` and
`DrafterStub` implements `DrafterLike` by forwarding calls with `dspark.serving.bls`.

The target stub keeps the slot bookkeeping local, so a decode step costs ONE hop to the
target (`verify`): `length` and `rollback` never leave the BLS model; a verify writes each
request's new tokens at the positions it names, which drops whatever the slot held at or past
them (the previous step's rejected drafts: the remote side of `rollback`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.interfaces import DrafterLike
from dspark.serving.bls import RemoteModel

TARGET_METHODS = ("describe", "allocate", "release", "prefill", "verify")
DRAFTER_METHODS = ("describe", "start", "release", "extend", "propose", "draft_probs", "flush")
# served only where the drafter has them (`describe` lists them; the stub exposes no others)
OPTIONAL_DRAFTER_METHODS = ("flush",)
# Tensor inputs each model declares in its config.pbtxt (besides `call`).
TARGET_TENSORS = ("tokens", "seq_idx", "positions", "cu_seqlens", "slots")
TARGET_OUTPUTS = ("result", "out_0", "out_1", "out_1_lengths")
DRAFTER_TENSORS = ("taps", "taps_lengths", "tokens", "cu_seqlens", "keep", "anchors", "uniforms", "lengths")
DRAFTER_OUTPUTS = ("result", "out_0", "out_1", "out_2")  # out_2: a hybrid DraftBlock.sources


class TargetServer:
    """The `target` model's object: a `TargetEngine` plus `describe` and the implicit rollback."""

    def __init__(self, target, model_folder: str = ""):
        self.target, self.model_folder = target, model_folder

    def describe(self) -> dict:
        t = self.target
        return {
            "vocab_size": t.vocab_size,
            "max_seq_len": t.max_seq_len,
            "tap_dim": t.tap_dim,
            "eos_token_ids": list(t.eos_token_ids),
            "capacity": t.cache.capacity,
            "model_folder": self.model_folder,
            "dtype": str(t.dtype).removeprefix("torch."),
            "device": str(t.device),
        }

    def allocate(self) -> int:
        return self.target.allocate()

    def release(self, slot: int) -> None:
        self.target.release(slot)

    def prefill(self, slots: list[int], prompts: list[list[int]]):
        for slot in slots:  # a prompt starts its slot afresh
            if self.target.length(slot):
                self.target.rollback(slot, 0)
        return self.target.prefill(slots, prompts)

    def verify(self, batch: RaggedBatch):
        cu = batch.cu_seqlens.tolist()
        starts = batch.positions[cu[:-1]].tolist() if batch.num_requests else []
        for slot, start in zip(batch.slots.tolist(), starts):
            if self.target.length(slot) > start:
                self.target.rollback(slot, start)  # drafts the last step rejected
        return self.target.verify(batch)


class TargetStub:
    """`TargetLike` inside the BLS model: slots are tracked here, forwards go to `model_name`."""

    def __init__(self, pb_utils, model_name: str = "target"):
        self.remote = RemoteModel(pb_utils, model_name, ("call",) + TARGET_TENSORS, TARGET_OUTPUTS)
        info = self._call("describe")
        self.info = info
        self.vocab_size, self.max_seq_len = int(info["vocab_size"]), int(info["max_seq_len"])
        self.tap_dim, self.capacity = int(info["tap_dim"]), int(info["capacity"])
        self.eos_token_ids = [int(t) for t in info["eos_token_ids"]]
        self.device = torch.device("cpu")  # where the returned tensors live (this process)
        self._lengths: dict[int, int] = {}

    def _call(self, method: str, *args: Any, names: tuple[str, ...] = ()) -> Any:
        return self.remote.call(method, *args, arg_names=list(names))

    def allocate(self) -> int:
        if len(self._lengths) >= self.capacity:
            raise RuntimeError(f"no free KV slot (capacity {self.capacity})")
        slot = int(self._call("allocate"))
        self._lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        del self._lengths[slot]
        self._call("release", slot, names=("slot",))

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"rollback of slot {slot} to {length}: must be in [0, {self._lengths[slot]}]")
        self._lengths[slot] = length

    def num_free_slots(self) -> int:
        return self.capacity - len(self._lengths)

    def prefill(self, slots: list[int], prompts: list[list[int]]):
        logits, taps = self._call(
            "prefill", list(slots), [list(map(int, p)) for p in prompts], names=("slots", "prompts")
        )
        for slot, prompt in zip(slots, prompts):
            self._lengths[slot] = len(prompt)
        return logits, taps

    def verify(self, batch: RaggedBatch):
        host = RaggedBatch(batch.tokens.cpu(), batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots)
        out = self._call("verify", host, names=("batch",))
        if batch.num_requests:
            ends = batch.positions[batch.cu_seqlens[1:] - 1].tolist()
            for slot, end in zip(batch.slots.tolist(), ends):
                self._lengths[slot] = end + 1
        return out


class DrafterServer:
    """The `drafter` model's object: any `DrafterLike` plus `describe`."""

    def __init__(self, drafter):
        self.drafter = drafter

    def describe(self) -> dict:
        d = self.drafter
        return {
            "gamma": int(d.gamma),
            "sts_temperatures": [float(t) for t in getattr(d, "sts_temperatures", None) or []],
            "sts_shifts": [float(b) for b in getattr(d, "sts_shifts", None) or []],
            "calibrated_sources": [int(c) for c in getattr(d, "calibrated_sources", None) or []],
            "kind": type(d).__name__,
            "optional": [m for m in OPTIONAL_DRAFTER_METHODS if callable(getattr(d, m, None))],
        }

    def __getattr__(self, name: str):
        if name in DRAFTER_METHODS:
            return getattr(self.drafter, name)
        raise AttributeError(name)


def _arg_names(protocol: type, method: str) -> list[str]:
    return [p for p in inspect.signature(getattr(protocol, method)).parameters if p != "self"]


class DrafterStub:
    """`DrafterLike` inside the BLS model: every protocol method is forwarded as it is."""

    def __init__(self, pb_utils, model_name: str = "drafter"):
        self.remote = RemoteModel(pb_utils, model_name, ("call",) + DRAFTER_TENSORS, DRAFTER_OUTPUTS)
        info = self.remote.call("describe", arg_names=[])
        self.info = info
        self.gamma = int(info["gamma"])
        self.sts_temperatures = [float(t) for t in info["sts_temperatures"]] or None
        self.sts_shifts = [float(b) for b in info.get("sts_shifts", [])] or None
        self.calibrated_sources = tuple(int(c) for c in info.get("calibrated_sources", []))
        self._names = {m: _arg_names(DrafterLike, m) for m in DRAFTER_METHODS
                       if m != "describe" and m not in OPTIONAL_DRAFTER_METHODS}
        # a lazy drafter's pending context work, forwarded where it has it (the engine times a
        # catch-up's flush apart from the next propose: `SpecEngine._settle_drafter`)
        self._names.update({m: [] for m in info.get("optional", []) if m in OPTIONAL_DRAFTER_METHODS})

    def __getattr__(self, method: str):
        names = self.__dict__.get("_names", {})
        if method not in names:
            raise AttributeError(method)

        def forward(*args: Any) -> Any:
            return self.remote.call(method, *args, arg_names=names[method])

        return forward
