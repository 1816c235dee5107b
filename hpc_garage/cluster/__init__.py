"""Internal: `hpc-garage run` and the handoff to the flow (ARCHITECTURE.md). The public API is `hpc_garage.__all__`."""
