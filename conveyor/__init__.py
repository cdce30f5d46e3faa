"""Conveyor: an OpenAI-compatible LLM gateway built as a pipeline over Kafka."""

__all__ = ["__version__"]

__version__ = "0.1.0"
