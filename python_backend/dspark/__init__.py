"""DSpark: confidence-scheduled speculative decoding, served by Triton Inference Server."""

__version__ = "0.1.0"
