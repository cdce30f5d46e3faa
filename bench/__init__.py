"""Benchmarks: what Conveyor's pipeline adds over calling an engine directly."""
