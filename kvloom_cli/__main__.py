"""`python -m kvloom_cli`: the kvloom command line."""

from kvloom_cli.main import main

main()
