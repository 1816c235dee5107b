"""Internal: the pure data model and resource math (ARCHITECTURE.md). The public API is `hpc_garage.__all__`."""
