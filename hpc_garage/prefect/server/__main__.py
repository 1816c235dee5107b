"""`python -m hpc_garage.prefect.server keep …`: the keeper (keeper.py), as managed.py starts it."""

import sys

from hpc_garage.prefect.server.keeper import keep

if sys.argv[1:2] != ["keep"]:
    sys.exit("usage: python -m hpc_garage.prefect.server keep --host HOST --port PORT --idle SECONDS")
sys.exit(keep(sys.argv[2:]))
