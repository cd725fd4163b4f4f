"""Flow control: the single-writer controller and what it owns (requests, priority bands, the KV ledger, evictions),
the `FlowControl` interface the proxy calls, and the read-only views its policies see (gateway/policies/)."""
