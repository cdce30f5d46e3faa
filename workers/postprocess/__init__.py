"""The postprocess layer: ordered, stop-checked, OpenAI-shaped replies."""

from workers.postprocess.layer import PostprocessLayer

__all__ = ["PostprocessLayer"]
