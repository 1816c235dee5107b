"""`python -m hpc_garage.doctor probe --site SITE --token TOKEN`: the doctor's probe, inside its job."""

from __future__ import annotations

import sys

from hpc_garage.doctor.probe import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] != ["probe"]:
        print("usage: python -m hpc_garage.doctor probe --site SITE --token TOKEN (run `hpc-garage doctor` instead)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[1:]))
