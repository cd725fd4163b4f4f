"""The benchmarks that must run a component's internals in process (the gateway's flow controller, the
worker's heartbeat loops): the only part of bench allowed to import them. Everything else in bench uses public
interfaces (the `holdback` CLI, HTTP, `holdback.contract`)."""
