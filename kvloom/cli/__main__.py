"""`python -m kvloom.cli`: the kvloom command line."""

from kvloom.cli.main import main

main()
