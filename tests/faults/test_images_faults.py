"""Images under a worker's SIGKILL: a streamed answer about an image whose
worker is killed mid-answer is finished by the other worker of the vision pool,
which reads the image back from the file store and sends it to the upstream
again, byte for byte, with what was already said; the client gets the answer
once, whole. The upstream (a small real HTTP server) answers each image's media
type and sha256 a character at a time, and goes on after a continuation."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.faults.test_delivery import assert_continued_elsewhere, kill_its_worker
from tests.pipeline.test_images import VISION, looking, sent_images
from tests.support.asgi import chat_events, serving
from tests.support.images import data_url, image_bytes
from tests.support.pipeline import TEST_MODELS, Pipeline, client

PACE_S = 0.03  # between characters: an answer about one image takes about 2.3 s


@dataclass
class PacedUpstream:
    base_url: str = ""
    # each request's images (media type, bytes) and its final assistant text, if any
    asked: list[tuple[list[tuple[str, bytes]], str | None]] = field(default_factory=list)


def _app(upstream: PacedUpstream) -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.json()
        images = sent_images(body)
        last = body["messages"][-1]
        said = last["content"] if last["role"] == "assistant" else None
        upstream.asked.append((images, said))
        whole = "".join(f"{kind} {hashlib.sha256(data).hexdigest()}\n" for kind, data in images)
        rest = whole[len(said or ""):]
        return StreamingResponse(chat_events(rest, PACE_S), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def upstream() -> Iterator[PacedUpstream]:
    made = PacedUpstream()
    with serving(_app(made), lifespan="off") as port:
        made.base_url = f"http://127.0.0.1:{port}"
        yield made


@pytest.fixture
def p(services: None, upstream: PacedUpstream,
      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """Two vision workers of one slot each behind the paced upstream."""
    logs = tmp_path_factory.mktemp("images-faults")
    models = logs / "models.toml"
    models.write_text(TEST_MODELS.read_text() + VISION)
    made = Pipeline(logs, models=models, CONVEYOR_FILES_DIR=str(logs / "files"))
    try:
        made.cli("topics")
        made.spawn("layers", "layer")
        made.start_worker("w0")
        for worker in ("eyes-a", "eyes-b"):
            made.spawn(worker, "infer", "--pool", "eyes", "--engine", "openai", "--worker-id",
                       worker, "--upstream", upstream.base_url, "--capacity", "1")
        made.spawn("gateway", "gateway")
        made.wait_ready()
        made.wait_workers(2, pool="eyes")
        yield made
    finally:
        made.close()


def test_a_worker_killed_mid_answer_leaves_the_image_to_the_other_whole(
        p: Pipeline, upstream: PacedUpstream) -> None:
    png = image_bytes("PNG", (64, 48), (10, 120, 200))
    whole = f"image/png {hashlib.sha256(png).hexdigest()}\n"
    upstream.asked.clear()
    killed: list[str] = []
    text, finishes, request_id = "", 0, ""
    for chunk in client(p).chat.completions.create(model="eyes", messages=looking(data_url(png)),
                                                   stream=True):
        request_id = request_id or chunk.id.removeprefix("chatcmpl-")
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        finishes += chunk.choices[0].finish_reason is not None
        if len(text) >= 5 and not killed:
            kill_its_worker(p, request_id, killed)
    assert killed and finishes == 1 and text == whole, text
    # both workers sent the image as it was sent; the second one after what was said
    assert [images for images, _ in upstream.asked] == [[("image/png", png)]] * 2
    first, again = (said for _, said in upstream.asked)
    assert first is None and again and whole.startswith(again), upstream.asked
    assert_continued_elsewhere(p, request_id, killed)
