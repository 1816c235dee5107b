"""Internal: Prefect's side (task runner, fast path, managed server; ARCHITECTURE.md). The public API is
`hpc_garage.__all__`."""
