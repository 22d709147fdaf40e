"""The rules for adapter names and paths, checked where they enter: the
--lora-modules flag, LoadLoRAAdapter and GenerateRequest.lora_name.

A name is also a model id on the OpenAI API (the gateway routes by it) and a
label value of the per-adapter metrics, so it is short and plain. A path is
read by every worker, never by the controlplane: it must be absolute so that
it does not depend on a daemon's working directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_NAME_LEN = 64
MAX_PATH_LEN = 4096
NAME_RULE = f"1 to {MAX_NAME_LEN} characters: letters, digits, '.', '_' and '-'"
_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAME_LEN}}}")


class LoRANameError(ValueError):
    """A name or path that breaks the rules; the message names the field."""


def check_lora_name(name: str, field: str, served_model_name: str = "") -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise LoRANameError(f"{field} {name[:80]!r} must be {NAME_RULE}")
    if served_model_name and name == served_model_name:
        raise LoRANameError(f"{field} {name!r} is the served model's own name: pick another "
                            f"(requests without lora_name already get the base model)")
    return name


def check_lora_path(path: str, field: str) -> str:
    if not path or len(path) > MAX_PATH_LEN:
        raise LoRANameError(f"{field} must be 1 to {MAX_PATH_LEN} characters, got {len(path)}")
    if "\x00" in path or not path.isprintable():
        raise LoRANameError(f"{field} must be printable text without NUL characters")
    if not path.startswith("/"):
        raise LoRANameError(f"{field} {path[:80]!r} must be an absolute path (the workers "
                            f"read it, from their own working directories)")
    return path


@dataclass(frozen=True)
class LoRARequest:
    """What a Request carries to name its adapter. lora_id is this load of
    it on the workers (a reload gets a new one); version is the digest of
    its files, which the prefix cache keys the request's blocks on."""

    lora_name: str
    lora_id: int
    version: str


def parse_lora_modules(items: list[str], served_model_name: str,
                       max_modules: int) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH ... into (name, path) pairs; ValueError
    naming the item at fault."""
    if len(items) > max_modules:
        raise LoRANameError(f"--lora-modules gives {len(items)} adapters; at most "
                            f"{max_modules} (raise --max-cpu-loras)")
    pairs: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise LoRANameError(f"--lora-modules {item[:80]!r}: write NAME=PATH")
        check_lora_name(name, "--lora-modules name", served_model_name)
        check_lora_path(path, f"--lora-modules {name}=PATH")
        if name in pairs:
            raise LoRANameError(f"--lora-modules names {name!r} twice")
        pairs[name] = path
    return tuple(pairs.items())
