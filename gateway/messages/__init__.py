"""Anthropic's Messages API (``POST /v1/messages``) over the chat pipeline: the
request and its mapping (``protocol``), the Message and error objects
(``objects``), the stream's events (``events``), the error shape on its path
(``errors``), serving (``serving``) and the route (``api_router``)."""

__all__: list[str] = []
