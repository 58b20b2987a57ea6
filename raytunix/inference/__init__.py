"""Inference: the continuous-batching engine and token sampling.

``from raytunix.inference import InferenceEngine`` imports JAX on first use only, so that
importing this package stays cheap for processes that never generate.
"""

from __future__ import annotations

__all__ = ["InferenceEngine"]


def __getattr__(name: str):
    if name == "InferenceEngine":
        from raytunix.inference.engine import InferenceEngine

        return InferenceEngine
    raise AttributeError(f"module 'raytunix.inference' has no attribute {name!r}")
