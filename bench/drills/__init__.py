"""The KV policy's failure drills, run against a real holdback stack on simulated replicas.

One stack (two replicas, each its own simulator process so one can be killed; gateway, Batch API,
processor, workers) runs the whole timeline: batch jobs throughout; off-peak realtime; a ramp that raises
the rate step by step until the gateway rejects, then holds (the peak); off-peak again; a single-tenant
burst; a cancellation storm; a bad scheduling config pushed live, judged by its tail latency and rolled
back; kill -9 of a worker and of a replica. The replicas run without preemption, so any KV over-commitment
shows as a counted out-of-memory instead of being hidden by recompute. Everything observed goes into one
raw record; `bench.drills.gates` turns it into figures and gates, `bench.report.drills` into the report.
"""
