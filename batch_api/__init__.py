"""OpenAI-compatible Files and Batches API, auth and tenants, dashboard, metrics."""
