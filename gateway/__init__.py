"""The gateway: OpenAI-compatible HTTP/SSE API in front of the pipeline."""

from gateway.app import build_app

__all__ = ["build_app"]
