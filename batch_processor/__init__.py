"""Batch processor: claim jobs, validate and expand JSONL, enqueue fairly, finalize, cancel, expire."""
