"""Reading a PEM file named by a flag (a certificate, a key, a CA bundle),
bounded and with one message that names the flag, for both daemons."""

from __future__ import annotations

import os
import stat

# A PEM bundle far larger than any CA chain is a wrong path (a log, a disk image).
MAX_PEM_BYTES = 1 << 20


def read_pem(flag: str, path: str) -> bytes:
    """The file's bytes; ValueError naming the flag for anything else."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{flag} {path}: not a regular file")
        if info.st_size > MAX_PEM_BYTES:
            raise ValueError(f"{flag} {path}: {info.st_size} bytes, more than a PEM file "
                             f"holds (limit {MAX_PEM_BYTES})")
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data
