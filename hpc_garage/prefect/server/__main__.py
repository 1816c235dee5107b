"""`python -m hpc_garage.prefect.server keep …`: the keeper (keeper.py), as managed.py starts it;
`python -m hpc_garage.prefect.server prefect server start …`: the server (serve.py), as the keeper starts it."""

import sys

USAGE = ("usage: python -m hpc_garage.prefect.server keep --host HOST --port PORT --idle SECONDS\n"
         "       python -m hpc_garage.prefect.server prefect server start [PREFECT'S OPTIONS]")

if sys.argv[1:2] == ["keep"]:
    from hpc_garage.prefect.server.keeper import keep

    sys.exit(keep(sys.argv[2:]))
if sys.argv[1:2] == ["prefect"]:
    from hpc_garage.prefect.server.serve import main

    sys.exit(main(sys.argv[2:]))
sys.exit(USAGE)
