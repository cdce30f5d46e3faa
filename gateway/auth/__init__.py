"""Who is asking: API keys, JWTs, tenants, and the limits that come with them."""
