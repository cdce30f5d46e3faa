"""What an error reply of the pipeline answers the client with."""

from __future__ import annotations

from gateway.replies import RETRY_AFTER_S, reply_error
from schemas.records import ErrorInfo, Reply


def error_reply(status: int, code: str) -> Reply:
    error = ErrorInfo(status=status, type="service_unavailable", code=code, param=None,
                      message="m")
    return {"error": error}  # type: ignore[typeddict-item]


def test_a_503_of_the_pipeline_says_when_to_retry() -> None:
    for code in ("server_overloaded", "no_worker_available", "pipeline_unavailable"):
        exc = reply_error(error_reply(503, code))
        assert exc.status == 503 and exc.code == code
        assert exc.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert reply_error(error_reply(400, "context_length_exceeded")).headers == {}
