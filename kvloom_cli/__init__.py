"""The `kvloom` command line and the local-cluster launcher (`kvloom up/run/down`):
the floor above the daemons (kvloom/__init__.py has the house).

Needs only the client install: the launcher starts the daemons as
subprocesses and imports them only where a Ray actor runs one
(ray_cluster.py), never at import time.
"""
