"""`holdback api`: serve the OpenAI-compatible Batch and Files API with uvicorn.

Configuration comes from the environment (HOLDBACK_*, DATABASE_URL, REDIS_URL), read once here.
"""

from __future__ import annotations

import argparse

import uvicorn

from batch_api.app import create_app
from holdback.logs import configure_json_logging
from holdback.env_flags import flags_from_env
from holdback.settings import Settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="holdback api", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = flags_from_env(parser, "api").parse_args(argv)
    configure_json_logging(None, args.log_level, adopt=("uvicorn", "uvicorn.error", "uvicorn.access"))
    app = create_app(Settings())
    # Our middleware logs every request as one JSON event, so uvicorn's access log is off. Forwarded headers
    # are believed only from HOLDBACK_TRUSTED_PROXIES (the app's own middleware): uvicorn's default believes
    # any process on this host.
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False, log_level=args.log_level,
                proxy_headers=False)
    return 0
