"""Local Kafka and Redis: the scripts that run them, and their Python face for
the fault tests and the benchmarks (infra/services.py)."""
