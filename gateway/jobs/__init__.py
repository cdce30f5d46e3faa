"""Async jobs at the gateway: batches and background responses."""
