"""argparse with every flag also readable from a KVLOOM_* environment variable.

`--max-num-seqs` reads KVLOOM_MAX_NUM_SEQS when the flag is absent; the flag
wins when both are given. Used by both daemons so compose files and Helm
charts can configure them with env alone. Env values are applied at parse
time over every action, so flags added through argument groups get them too.
"""

from __future__ import annotations

import argparse
import os


def env_name(flag: str) -> str:
    return "KVLOOM_" + flag.lstrip("-").replace("-", "_").upper()


_SKIP = (argparse._HelpAction, argparse._VersionAction)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options default to their KVLOOM_* variable."""

    def parse_known_args(self, args=None, namespace=None):
        self._apply_env()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._apply_env()
        return super().format_help()

    def _apply_env(self) -> None:
        if getattr(self, "_env_applied", False):
            return
        self._env_applied = True
        for action in self._actions:
            flags = [o for o in action.option_strings if o.startswith("--")]
            if not flags or isinstance(action, _SKIP):
                continue
            var = env_name(flags[0])
            action.help = f"{action.help or ''} [env {var}]".strip()
            raw = os.environ.get(var)
            if raw is not None and raw != "":
                action.default = _parse_env(raw, action, var)
                action.required = False


def _parse_env(raw: str, action: argparse.Action, var: str):
    if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise SystemExit(f"{var}={raw!r}: expected true/false")
    convert = action.type or str
    try:
        value = convert(raw)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"{var}={raw!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"{var}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value
