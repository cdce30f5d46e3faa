"""``POST /v1/embeddings``: the route and its serving."""
