"""Content policies: what a tenant's requests and answers may hold (safety lists,
personal data, the prompt cache)."""
