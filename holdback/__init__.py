"""holdback: self-hosted OpenAI Batch API that shares GPUs with realtime traffic.

This package owns what every component shares: settings, the database models and engine,
file storage, the Redis connection and queue names, result recording and the `holdback` CLI.
"""

__version__ = "0.1.0"
