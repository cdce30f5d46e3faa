"""The route layer: resolve the model to a pool."""

from workers.route.layer import RouteLayer

__all__ = ["RouteLayer"]
