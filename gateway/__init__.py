"""The gateway: OpenAI-compatible HTTP/SSE API in front of the pipeline
(``gateway.app.build_app``). The package imports nothing itself, so a process
that needs one of its modules (the CLI's audit writer, say) does not load the
whole web application."""
