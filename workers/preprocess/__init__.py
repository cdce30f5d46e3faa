"""Preprocess: validate, normalise, measure and fit requests to their model."""

from workers.preprocess.layer import PreprocessLayer

__all__ = ["PreprocessLayer"]
