"""`python -m deepinfer` runs the command line."""

from deepinfer_cli.app import main

main()
