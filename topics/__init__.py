"""Topic catalog, topic creation, Kafka client factories and the event envelope."""

from topics.catalog import TopicSpec, catalog, infer_topic
from topics.clients import make_consumer, make_producer
from topics.envelope import new_envelope, now_ms, now_us, stamp

__all__ = ["TopicSpec", "catalog", "infer_topic", "make_consumer", "make_producer", "new_envelope",
           "now_ms", "now_us", "stamp"]
