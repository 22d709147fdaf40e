"""Reading the secret files the daemons' flags name (a PEM certificate, key
or CA bundle; the worker auth token), bounded, with one message that says
what is wrong, for both daemons."""

from __future__ import annotations

import os
import stat

# A PEM bundle far larger than any CA chain is a wrong path (a log, a disk image).
MAX_PEM_BYTES = 1 << 20
# A token is a line of text; a bigger "token file" is the wrong file.
MAX_TOKEN_FILE_BYTES = 64 * 1024


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


def read_token_file(path: str) -> str:
    """The file's text, stripped; ValueError says what is wrong with it."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_TOKEN_FILE_BYTES:
            raise ValueError(f"{info.st_size} bytes; a token file holds one line")
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    if not token:
        raise ValueError("the file is empty; put the token in it (or drop the flag)")
    return token
