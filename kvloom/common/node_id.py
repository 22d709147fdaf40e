"""A rank's node id: where an orchestrator placed it (a Ray node id, a
Kubernetes node name). The worker sends it at registration and the
controlplane shows it in logs and GetServerInfo, so both sides hold it to
the same bound: printable ASCII without spaces (it is written into log
lines, where a newline could forge one), at most MAX_NODE_ID_CHARS."""

from __future__ import annotations

import re

# Ray's node ids are 56 hex characters, Kubernetes node names at most 63
# per DNS label (253 in all, but nodes are named far shorter in practice).
MAX_NODE_ID_CHARS = 128
_NODE_ID = re.compile(r"[!-~]*")


def node_id_problem(value: str) -> str | None:
    """What is wrong with a node id, or None when it may be used."""
    if len(value) > MAX_NODE_ID_CHARS:
        return f"has {len(value)} characters; at most {MAX_NODE_ID_CHARS}"
    if not _NODE_ID.fullmatch(value):
        return "must be printable ASCII without spaces"
    return None
