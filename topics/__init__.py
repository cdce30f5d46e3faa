"""Conveyor's Kafka door: the topic catalog, topic creation, client factories,
the readers (follow, lookup) and the event envelope."""
