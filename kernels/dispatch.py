"""The one kernel dispatcher: Triton kernel or torch reference, decided in one place.

DSPARK_KERNELS=triton forces the kernels (tests run them on the CPU with TRITON_INTERPRET=1),
=torch forces the references, otherwise (auto) the kernels run when every tensor is on CUDA.
Kernel modules are imported lazily: Triton decides compiler or interpreter at import time,
and the CPU path never needs Triton at all."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from dspark_kernels import reference

# name -> (kernel module, Triton implementation, torch reference in dspark_kernels.reference)
KERNELS: dict[str, tuple[str, str, str]] = {
    "rejection_sample": ("dspark_kernels.rejection", "rejection_sample_triton", "rejection_sample_ref"),
    "block_sample": ("dspark_kernels.block_sample", "block_sample_triton", "block_sample_ref"),
    "varlen_attention": ("dspark_kernels.varlen_attention", "varlen_attention_triton",
                         "varlen_attention_ref"),
}


def use_triton(*tensors: torch.Tensor) -> bool:
    """Kernel (True) or torch reference (False) for inputs `tensors` (see module docstring)."""
    return use_triton_on(*(t.device for t in tensors))


def use_triton_on(*devices: torch.device) -> bool:
    """The same decision for inputs that will live on `devices`."""
    mode = os.environ.get("DSPARK_KERNELS", "auto")
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"DSPARK_KERNELS must be auto, triton or torch, got {mode!r}")
    if mode != "auto":
        return mode == "triton"
    return bool(devices) and all(torch.device(d).type == "cuda" for d in devices)


def kernel(name: str, *tensors: torch.Tensor) -> Callable:
    """The implementation of kernel `name` for inputs `tensors`: Triton or reference."""
    if name not in KERNELS:
        raise KeyError(f"unknown kernel {name!r} (known: {', '.join(KERNELS)})")
    module, triton_fn, ref_fn = KERNELS[name]
    if use_triton(*tensors):
        return getattr(importlib.import_module(module), triton_fn)
    return getattr(reference, ref_fn)
