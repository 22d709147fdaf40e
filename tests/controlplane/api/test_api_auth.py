"""API keys without a server (controlplane/api/auth.py): the key file's
format, authentication of call metadata, the constant-time comparison,
reloads (and their SIGHUP wiring), and the tenant's cache salt."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal

import pytest

from controlplane.api import auth
from controlplane.api.auth import ApiKeys, KeyFileError, read_key_file, tenant_cache_salt

KEY_A = "ka-0123456789abcdef"
KEY_B = "kb-fedcba9876543210"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# tenants\n\n  {KEY_A}  \n# {KEY_B} is not a key: a comment\n")
    return path


def test_key_file_skips_blank_lines_and_comments(key_file):
    assert read_key_file(str(key_file)) == [KEY_A]


@pytest.mark.parametrize(("content", "problem"), [
    ("", "holds no key"),
    ("# only a comment\n\n", "holds no key"),
    (f"{KEY_A}\nhas a space\n", "line 2: an API key must be visible ASCII"),
    ("tab\there\n", "line 1: an API key must be"),
    ("x" * 257 + "\n", "line 1: an API key must be"),
    ("clé\n", "line 1: an API key must be"),
])
def test_bad_key_files_are_refused_without_echoing_keys(tmp_path, content, problem):
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(KeyFileError, match=problem) as info:
        ApiKeys(str(path))
    assert KEY_A not in str(info.value) and "here" not in str(info.value)


def test_missing_key_file_names_the_flag(tmp_path):
    with pytest.raises(KeyFileError, match="--api-key-file .*cannot read it"):
        ApiKeys(str(tmp_path / "absent"))


def test_env_key_alone_and_combined_with_the_file(key_file):
    assert len(ApiKeys(env_key=KEY_B)) == 1
    keys = ApiKeys(str(key_file), KEY_B)
    assert len(keys) == 2
    assert keys.tenant_of(KEY_A) and keys.tenant_of(KEY_B)
    with pytest.raises(KeyFileError, match="KVLOOM_API_KEY"):
        ApiKeys(env_key="two words")


def test_authenticate_accepts_a_bearer_key_and_names_its_tenant(key_file):
    keys = ApiKeys(str(key_file), KEY_B)
    a, why = keys.authenticate(bearer(KEY_A))
    assert why == "" and a is not None
    b, _ = keys.authenticate((("x-other", "1"), ("authorization", f"bearer  {KEY_B}")))
    assert b is not None and a != b
    # Stable across instances (and so restarts and reloads), and not the key.
    assert ApiKeys(env_key=KEY_A).tenant_of(KEY_A) == a
    assert KEY_A not in a and len(a) == auth.TENANT_ID_HEX


@pytest.mark.parametrize(("metadata", "problem"), [
    ((), "requires an API key: send gRPC metadata 'authorization: Bearer <key>'"),
    (bearer("wrong-key"), "the API key is not valid; send"),
    ((("authorization", KEY_A),), "is not 'Bearer <key>'"),
    ((("authorization", f"Basic {KEY_A}"),), "is not 'Bearer <key>'"),
    ((("authorization", "Bearer "),), "is not 'Bearer <key>'"),
    ((("authorization", "Bearer " + "k" * 300),), "is no API key"),
    ((*bearer(KEY_A), *bearer(KEY_A)), "send one authorization header, not 2"),
])
def test_authenticate_refuses_saying_what_to_send(key_file, metadata, problem):
    tenant, why = ApiKeys(str(key_file)).authenticate(metadata)
    assert tenant is None
    assert problem in why
    assert KEY_A not in why and "wrong-key" not in why


def test_every_key_is_compared_whichever_matches(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    many = [f"key-{i:04d}" for i in range(50)]
    path.write_text("\n".join(many))
    keys = ApiKeys(str(path))
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented in (many[0], many[-1], "nope", "x" * 200):
        calls.clear()
        keys.tenant_of(presented)
        # No early exit, and always equal lengths (digests): the time taken
        # says nothing about which key matched or how long the keys are.
        assert len(calls) == len(many)
        assert all(a == b == 32 for a, b in calls)


def test_reload_adds_and_removes_keys(key_file, caplog):
    keys = ApiKeys(str(key_file))
    assert keys.tenant_of(KEY_B) is None
    key_file.write_text(f"{KEY_B}\n")
    with caplog.at_level(logging.INFO, "controlplane.api.auth"):
        assert keys.reload()
    assert keys.tenant_of(KEY_B) is not None and keys.tenant_of(KEY_A) is None
    assert "API keys reloaded: 1 key(s)" in caplog.text
    assert KEY_B not in caplog.text


@pytest.mark.parametrize("damage", ["empty", "unreadable", "malformed"])
def test_reload_keeps_the_old_keys_when_the_file_is_bad(key_file, caplog, damage):
    keys = ApiKeys(str(key_file))
    if damage == "empty":
        key_file.write_text("# all revoked?\n")
    elif damage == "unreadable":
        os.remove(key_file)
    else:
        key_file.write_text("has space\n")
    with caplog.at_level(logging.WARNING, "controlplane.api.auth"):
        assert not keys.reload()
    assert keys.tenant_of(KEY_A) is not None
    assert "API keys not reloaded, the 1 current key(s) stay" in caplog.text


def test_sighup_reloads_the_key_file(key_file):
    keys = ApiKeys(str(key_file))

    async def scenario():
        loop = asyncio.get_running_loop()
        auth.install_reload(loop, keys)
        try:
            key_file.write_text(f"{KEY_A}\n{KEY_B}\n")
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(400):
                if len(keys) == 2:
                    break
                await asyncio.sleep(0.005)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)

    asyncio.run(scenario())
    assert keys.tenant_of(KEY_B) is not None


def test_tenant_cache_salt():
    assert tenant_cache_salt(None, "s", "key") == "s"  # no keys: the client's salt
    assert tenant_cache_salt("a" * 16, "s", "global") == "s"
    assert tenant_cache_salt("a" * 16, None, "global") is None
    a, b = "a" * 16, "b" * 16
    assert tenant_cache_salt(a, None, "key") == tenant_cache_salt(a, "", "key")
    # Whatever salt tenant b sends, it never reproduces one of tenant a's.
    for salt in (None, "", "x", f"tenant:{a}/x", f"{a}/"):
        assert tenant_cache_salt(b, salt, "key") != tenant_cache_salt(a, salt, "key")
        assert not tenant_cache_salt(b, salt, "key").startswith(f"tenant:{a}/")


def test_refusals_are_logged_at_most_once_per_interval(caplog):
    log = auth.RefusalLog(interval_s=3600)
    with caplog.at_level(logging.WARNING, "controlplane.api.auth"):
        for _ in range(5):
            log.refused("ipv4:127.0.0.1:5555", "the API key is not valid")
    (record,) = caplog.records
    assert "refused 1 call(s) without a valid API key" in record.getMessage()
    assert "ipv4:127.0.0.1:5555: the API key is not valid" in record.getMessage()
