"""The `HPC_GARAGE_*` names core's pure functions write into a worker's environment (core reads none).

Core imports nothing outside core, so a name it writes lives here; `hpc_garage.variables` re-exports it with
every other name, and tests/test_architecture.py holds each name to one spelling in one place.
"""

CPUS_ENV = "HPC_GARAGE_CPUS"  # a bound worker's CPUs (`0-7`): its process binds itself to them at start
