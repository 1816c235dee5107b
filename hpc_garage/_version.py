"""The package's version, alone in a module that imports nothing: the job script stamps it and the CLI shows it
without importing the package root (whose functions import prefect/), and hatch reads it when building."""

__version__ = "0.1.0"
