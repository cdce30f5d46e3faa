"""The Messages route as the OpenAPI document shows it: its body and Anthropic's
error statuses."""

from __future__ import annotations

from conveyor.settings import load_settings
from gateway.app import build_app


def test_the_openapi_document_shows_the_route() -> None:
    operation = build_app(load_settings()).openapi()["paths"]["/v1/messages"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "max_tokens", "messages"} <= set(body["required"])
    assert "$ref" not in str(body)
    assert {"200", "400", "401", "404", "429", "529"} <= set(operation["responses"])
    error = operation["responses"]["529"]["content"]["application/json"]["schema"]
    assert error["properties"]["type"] == {"const": "error"}
