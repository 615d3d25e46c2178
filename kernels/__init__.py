"""`dspark_kernels`: Triton-language kernels for DSpark, each beside its torch reference.

- rejection: ragged lossless rejection sampling (reference: dspark.runtime.verify.rejection_sample_ref)
- varlen_attention: verification attention over the slot KV cache, GQA
- block_sample: the drafter's sequential-head block sampling (temperature / top-k / top-p)
- bench: CUDA timings vs the references -> results/kernels_<gpu>.json

Submodules are not imported here on purpose: Triton chooses compiler or interpreter
(TRITON_INTERPRET=1) when a kernel module is imported, so callers import them lazily.
"""
