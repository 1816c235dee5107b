"""The job script of `hpc-garage doctor --job`: its COMMAND under `hpc-garage run` (hpc_garage/doctor/probe.py).

A file of its own, in a folder with no Python modules beside it, because `submit` runs a script by its path
and Python puts the script's folder first on sys.path.
"""

import sys

from hpc_garage.doctor.probe import main

if __name__ == "__main__":
    sys.exit(main())
