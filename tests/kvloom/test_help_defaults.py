"""Every kvloom command's --help shows the defaults, but never a secret's:
--auth-token's default comes from KVLOOM_AUTH_TOKEN, --api-key's from
KVLOOM_API_KEY."""

from __future__ import annotations

import subprocess
import sys

import pytest

SECRET = "s3cr3t-from-env"


@pytest.mark.parametrize(("module", "shown"), [
    (["controlplane"], "(default: 50051)"),
    (["workerd"], "(default: 120.0)"),
    (["kvloom_cli", "up"], "(default: 1)"),
    (["kvloom_cli", "run"], "(default: 1)"),
])
def test_help_shows_defaults_but_not_the_auth_token(module, shown, monkeypatch):
    monkeypatch.setenv("KVLOOM_AUTH_TOKEN", SECRET)
    done = subprocess.run([sys.executable, "-m", *module, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert shown in done.stdout
    assert "--auth-token" in done.stdout
    assert SECRET not in done.stdout


@pytest.mark.parametrize(("argv", "shown"), [
    (["lora", "load"], "(default: 300.0)"),
    (["lora", "list"], "(default: False)"),
    (["generate"], "the base model [env KVLOOM_LORA] (default: None)"),
])
def test_help_of_client_commands_hides_the_api_key(argv, shown, monkeypatch):
    # --api-key's default comes from KVLOOM_API_KEY.
    monkeypatch.setenv("KVLOOM_API_KEY", SECRET)
    done = subprocess.run([sys.executable, "-m", "kvloom_cli", *argv, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # undo the help's line wrapping
    assert shown in out
    assert "--api-key" in out
    assert SECRET not in out
