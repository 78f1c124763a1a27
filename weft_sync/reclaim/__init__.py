"""Reclaim: engine liveness, candidate discovery and the takeover target."""
