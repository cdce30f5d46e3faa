"""The infer layer: workers that run an engine over a pool's task topic."""
