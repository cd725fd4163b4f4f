"""What the benchmarks share: starting holdback, simulator and gateway processes (one stack, a multi-host
cluster, an S3 server), ports and readiness, realtime traffic and drill workloads, Prometheus read-outs and
per-process CPU. Only public interfaces: the `holdback` CLI, HTTP and `holdback.contract`."""
