"""The `holdback` command: one entry point whose subcommands live in their components.

Each subcommand is a module with `main(argv) -> int`; it is imported only when run, so
`holdback sim` never loads the database layer and `holdback --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("holdback.cli.up", "run the whole platform on this machine (what `make up` runs)"),
    "api": ("batch_api.cli", "serve the OpenAI-compatible Batch and Files API and the dashboard"),
    "db": ("holdback.cli.db", "database schema: `holdback db upgrade`"),
    "keys": ("holdback.cli.keys", "API keys: `holdback keys create --tenant NAME`, `list`, `revoke KEY_ID`"),
    "data": ("holdback.cli.data", "the data dir: `holdback data usage` (what grows, what bounds it), `trim-logs`"),
    "files": ("holdback.cli.files", "file retention: `holdback files gc` deletes expired files once"),
    "processor": ("batch_processor.cli", "claim, validate, expand, enqueue, finalize, cancel and expire batches"),
    "worker": ("async_processor.cli", "send queued batch requests through the gateway (`-n` concurrency)"),
    "gateway": ("gateway.cli", "priority-aware gateway in front of vLLM replicas"),
    "sim": ("model_sim.cli", "vLLM-compatible model server simulator replicas"),
    "submit": ("holdback.cli.submit", "run a JSONL file as a batch: upload, wait with progress, download the results"),
    "demo": ("holdback.cli.demo", "realtime alone, beside a batch with no controls, and through holdback (own platform)"),
    "bench": ("bench.cli", "benchmarks: `holdback bench study` runs the priority study (holdback and eviction against realtime)"),
}
# Commands that are a platform process: each reports its spans as service `holdback-<command>` (holdback.tracing).
TRACED = ("api", "processor", "worker", "gateway", "sim")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="holdback",
        description="Self-hosted batch inference that shares GPUs with realtime traffic.",
        epilog="Run `holdback COMMAND --help` for a command's options.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"holdback {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("holdback")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from holdback import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        parser.parse_args(argv[:1])  # prints the version and exits
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose one of: {', '.join(COMMANDS)}")
    if name in TRACED:
        from holdback import tracing

        try:
            tracing.configure(f"holdback-{name}")
        except tracing.TracingConfigError as exc:
            print(f"holdback {name}: {exc}", file=sys.stderr)
            return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
