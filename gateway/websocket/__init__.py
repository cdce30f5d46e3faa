"""WebSocket endpoints: multiplexed chat and completions, and the Responses API's
WebSocket mode. ``protocol`` holds the messages, their framing and the
connection, ``chat`` and ``responses`` the two modes, ``api_router`` the routes."""

__all__: list[str] = []
