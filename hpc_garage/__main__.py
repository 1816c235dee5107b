from hpc_garage.cli import main

main()
