"""OpenAI's Responses API (``POST /v1/responses``), text only: the request model
(``protocol``), the Response object (``objects``), its stream events
(``events``), serving through the chat pipeline (``serving``) and the route
(``api_router``); ``types`` states the contract of background responses."""

__all__: list[str] = []
