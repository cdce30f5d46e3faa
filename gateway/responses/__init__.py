"""OpenAI's Responses API (``POST /v1/responses``), text only: the Response object
(``objects``), its stream events (``events``), serving through the chat
pipeline (``serving``) and the route (``api_router``)."""

__all__: list[str] = []
