"""Serving embeddings: the request checked against its model (an embedding
model; the width it has; every vector fitting one answer event), admitted and
submitted like any request, answered with the body postprocess built
(docs/api/embeddings.md)."""

from __future__ import annotations

from fastapi.responses import Response
from starlette.requests import Request

from conveyor.errors import InvalidRequest, RequestError
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway.submission import Submitter
from schemas.openai.embeddings import EmbeddingBody, embedding_generation, too_many_inputs

__all__ = ["EmbeddingServing"]


class EmbeddingServing:
    """``/v1/embeddings``: what its route dispatches to."""

    def __init__(self, settings: Settings, submitter: Submitter, registry: Registry) -> None:
        self.settings = settings
        self.submitter = submitter
        self.registry = registry

    async def create(self, body: EmbeddingBody, request: Request) -> Response:
        generation = embedding_generation(body)
        self._check(body)
        answer = await self.submitter.admit_and_submit(generation, request)
        try:
            reply = await answer.first(request.is_disconnected)
            if reply is None:  # the client left
                return Response(status_code=499)
            while reply is not None and reply["kind"] != "final":
                reply = await answer.next()
        except RequestError as exc:
            exc.headers = {**answer.ticket.headers, "x-request-id": answer.request_id,
                           **exc.headers}
            raise
        finally:
            answer.close("the embeddings were answered, or the client left")
        assert reply is not None
        return Response(reply["chunk"], media_type="application/json", headers={
            **answer.ticket.headers, "x-request-id": answer.request_id})

    def _check(self, body: EmbeddingBody) -> None:
        """What the gateway knows already: the model serves embeddings, of this
        width, and the answer fits one event (the pipeline checks again)."""
        spec = self.registry.find(body.model)
        if spec is None:
            return  # route answers 404 (or the key's allow-list, 403, before it)
        if spec.kind != "embedding":
            raise InvalidRequest(f"The model `{body.model}` does not serve embeddings: ask an "
                                 "embedding model.", param="model")
        width = spec.dimensions
        if width is None:
            return
        if body.dimensions is not None and body.dimensions != width:
            raise InvalidRequest(f"The model `{body.model}` does not support specifying "
                                 f"dimensions other than {width}.", param="dimensions")
        refusal = too_many_inputs(len(body.inputs()), width, body.encoding_format,
                                  self.settings.kafka.max_event_bytes)
        if refusal is not None:
            raise refusal
