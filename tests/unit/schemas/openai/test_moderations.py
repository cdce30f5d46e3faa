"""``POST /v1/moderations``' body (schemas/openai/moderations.py): every input
is read, or the request is a 400 naming ``input``; never a silent cut."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.errors import install_error_handlers
from schemas.openai.moderations import MAX_INPUTS, ModerationBody


def moderation_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/moderations")
    async def moderations(body: ModerationBody) -> dict[str, Any]:
        return {"texts": body.texts()}

    return app


def test_every_input_up_to_the_limit_is_read() -> None:
    texts = [f"text {i}" for i in range(MAX_INPUTS)]
    assert ModerationBody(input=texts).texts() == texts
    assert ModerationBody(input=[{"type": "text", "text": "a"}]).texts() == ["a"]
    assert ModerationBody(input="one").texts() == ["one"]


def test_more_inputs_than_the_limit_is_a_400_naming_input() -> None:
    texts = ["Hello there"] * 40 + ["you are a worthless idiot"]
    with TestClient(moderation_app()) as client:
        for body in ({"input": texts},
                     {"input": [{"type": "text", "text": t} for t in texts]}):
            r = client.post("/v1/moderations", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "input"
            assert "41" in error["message"] and str(MAX_INPUTS) in error["message"]
        r = client.post("/v1/moderations", json={"input": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
