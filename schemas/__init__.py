"""Avro schemas for every Conveyor event, their typed mirrors, and the codec.

Declarative: nothing here imports a web framework, an engine or a Kafka client.
"""
