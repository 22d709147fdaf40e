"""The --help formatter of every kvloom command: each option shows its default,
except a secret's (--auth-token's default may come from KVLOOM_AUTH_TOKEN,
--api-key's from KVLOOM_API_KEY, which --help must not print)."""

from __future__ import annotations

import argparse

SECRET_WORDS = ("token", "secret", "password", "api-key")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if any(word in flag for flag in action.option_strings for word in SECRET_WORDS):
            return action.help
        return super()._get_help_string(action)
