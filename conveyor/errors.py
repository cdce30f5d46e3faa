"""The project's one root exception and its subclasses, grouped by area.

A :class:`RequestError` is a failure that belongs to one request and reaches
its client as an OpenAI error envelope with an HTTP status. Everything else
is an operational failure of a component.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConveyorError", "RequestError", "InvalidRequest", "ContentPolicyViolation",
           "InvalidOutput", "ModelNotFound", "ContextLengthExceeded", "NoWorkerAvailable",
           "Overloaded", "DeadlineExceeded", "EngineError", "RequestTooLarge", "InvalidApiKey",
           "RateLimited", "QuotaExceeded", "PipelineUnavailable", "SchemaError", "BrokerError",
           "TransientBrokerError", "PermanentBrokerError", "RedisUnavailable", "RedisRefused",
           "StartupTimeout", "last_line"]


class ConveyorError(Exception):
    """Root of every error Conveyor raises on purpose."""


class RequestError(ConveyorError):
    """A failure of one request, shown to its client in OpenAI's envelope."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # HTTP headers the response carries (Retry-After, x-ratelimit-*)
        self.headers: dict[str, str] = dict(headers or {})
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(RequestError):
    status = 400
    type = "invalid_request_error"


class ContentPolicyViolation(InvalidRequest):
    """The request holds what its content policy blocks (conveyor/policy)."""
    code = "content_policy_violation"


class InvalidOutput(RequestError):
    """The model's finished answer is not what the request's response_format
    asked for (a schema keyword its grammar could not hold it to)."""
    code = "invalid_structured_output"


class ModelNotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class NoWorkerAvailable(RequestError):
    status = 503
    type = "service_unavailable"
    code = "no_worker_available"


class Overloaded(RequestError):
    """No worker had room for the request in time (the gateway adds Retry-After)."""
    status = 503
    type = "service_unavailable"
    code = "server_overloaded"


class DeadlineExceeded(RequestError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"


class EngineError(RequestError):
    code = "engine_error"


class RequestTooLarge(InvalidRequest):
    """More than the pipeline can carry in one event (or than the gateway takes)."""

    status = 413
    code = "request_too_large"


class InvalidApiKey(RequestError):
    """No key, or one that is unknown, revoked or expired (or a JWT that does not verify)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RateLimited(RequestError):
    """Over a requests-, tokens- or concurrency-per-key or per-tenant limit: retry later."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class QuotaExceeded(RequestError):
    """A tenant's daily or monthly token quota is spent."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class PipelineUnavailable(RequestError):
    """Kafka (or Redis) cannot be reached: nothing can be said about workers."""

    status = 503
    type = "service_unavailable"
    code = "pipeline_unavailable"


class SchemaError(ConveyorError):
    """An event that cannot be decoded or encoded (a poison event)."""


class BrokerError(ConveyorError):
    """Kafka or Redis failed underneath a component (translated at the boundary)."""


class TransientBrokerError(BrokerError):
    """Kafka or Redis is unreachable or slow for now: retry with backoff."""


class PermanentBrokerError(BrokerError):
    """Kafka or Redis refused this for good (too large, not allowed): give up on it."""


class RedisUnavailable(TransientBrokerError):
    """Redis is unreachable or slow for now (translated in conveyor/redis_clients.py)."""


class RedisRefused(PermanentBrokerError):
    """Redis refused a command (a script's error, a key of the wrong type)."""


class StartupTimeout(ConveyorError):
    """A process gave up starting: something it waited for (the broker, its
    consumer group, Redis) did not come within ``startup_timeout_s``. The
    message says what, for how long, and where (see conveyor/startup.py)."""

    def __init__(self, message: str, *, what: str, waited_s: float, where: str = "") -> None:
        super().__init__(message)
        self.what = what
        self.waited_s = waited_s
        self.where = where


def last_line(text: str) -> str:
    """The last non-empty line of ``text``: a traceback's error, as the log tools
    and a dead letter's reader show it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
