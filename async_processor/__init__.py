"""Async workers: send queued requests through the gateway, retry evictions, record one final result."""
