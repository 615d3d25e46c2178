"""`dspark_kernels`: Triton-language kernels for DSpark, their torch references and one dispatcher.

- reference: the torch references and shared constants (no Triton import)
- dispatch: `kernel(name, *tensors)` picks the Triton kernel (CUDA, or DSPARK_KERNELS=triton)
  or the reference; the only place that decides
- rejection: ragged lossless rejection sampling on the flat draft layout
- varlen_attention: verification attention over the slot KV cache, GQA
- block_sample: the drafter's sequential-head block sampling (temperature / top-k / top-p)
- bench: CUDA timings vs the references -> results/kernels_<gpu>.json

This package depends on torch (and Triton for the kernels) only, never on `dspark`.
Kernel modules are not imported here: Triton chooses compiler or interpreter
(TRITON_INTERPRET=1) when a kernel module is imported, so the dispatcher imports them lazily.
"""
