"""Priority-aware gateway: flow control, holdback ceilings, in-flight eviction, endpoint picking."""
