"""argparse with every flag also readable from a KVLOOM_* environment variable.

`--max-num-seqs` reads KVLOOM_MAX_NUM_SEQS when the flag is absent; the flag
wins when both are given. Used by both daemons so compose files and Helm
charts can configure them with env alone.
"""

from __future__ import annotations

import argparse
import os


def env_name(flag: str) -> str:
    return "KVLOOM_" + flag.lstrip("-").replace("-", "_").upper()


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to their KVLOOM_* variable."""

    def add_argument(self, *names, **kwargs):  # type: ignore[override]
        flags = [n for n in names if n.startswith("--")]
        if flags and kwargs.get("action") not in ("help", "version"):
            var = env_name(flags[0])
            raw = os.environ.get(var)
            if raw is not None and raw != "":
                kwargs["default"] = _parse_env(raw, kwargs, var)
                kwargs["required"] = False
            help_text = kwargs.get("help", "")
            kwargs["help"] = f"{help_text} [env {var}]".strip()
        return super().add_argument(*names, **kwargs)


def _parse_env(raw: str, kwargs: dict, var: str):
    action = kwargs.get("action")
    if action == "store_true" or action == "store_false":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise SystemExit(f"{var}={raw!r}: expected true/false")
    if action is argparse.BooleanOptionalAction:
        return _parse_env(raw, {"action": "store_true"}, var)
    convert = kwargs.get("type", str)
    try:
        value = convert(raw)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"{var}={raw!r}: {exc}") from None
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise SystemExit(f"{var}={raw!r}: choose from {', '.join(map(str, choices))}")
    return value
