"""`python -m hpc_garage.compat [--latest]`: the installed versions against the verified ranges."""

from hpc_garage.compat.versions import main

raise SystemExit(main())
