"""The `kvloom` command line and the local-cluster launcher (`kvloom up/run/down`).

Needs only the client install: the launcher starts the daemons as
subprocesses and never imports them.
"""
