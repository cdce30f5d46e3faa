"""The pipeline's layers and the consumer runtime they share."""
