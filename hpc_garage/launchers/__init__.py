"""Launchers turn WorkerSpecs into running Dask workers: `local` (this machine), `mpi` (ranks inside one
allocation), `jobqueue` (worker jobs through dask-jobqueue). Each is a small module; they share `common`."""
