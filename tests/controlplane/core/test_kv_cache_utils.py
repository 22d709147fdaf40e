"""Block hash chain: stable, parent-dependent, salted, and incremental."""

from __future__ import annotations

from controlplane.core import kv_cache_utils
from controlplane.core.kv_cache_utils import NONE_HASH, hash_block_tokens, update_block_hashes
from tests.controlplane.core.helpers import make_request


def test_hash_is_stable_and_chained():
    h1 = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(NONE_HASH, [1, 2, 3, 5])
    # Same tokens under a different parent are a different block.
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(NONE_HASH, [5, 6, 7, 8])


def test_only_full_blocks_are_hashed():
    req = make_request(list(range(10)))
    hashes = update_block_hashes(req, 4)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hash_block_tokens(NONE_HASH, [0, 1, 2, 3]), [4, 5, 6, 7])


def test_cache_salt_changes_the_whole_chain():
    plain = make_request(list(range(8)))
    salted = make_request(list(range(8)))
    salted.cache_salt = "tenant-a"
    a, b = update_block_hashes(plain, 4), update_block_hashes(salted, 4)
    assert a[0] != b[0] and a[1] != b[1]


def test_fast_path_matches_hash_block_tokens():
    req = make_request(list(range(100, 150)))
    req.cache_salt = "s"
    hashes = update_block_hashes(req, 8)
    parent = NONE_HASH
    for i in range(6):
        parent = hash_block_tokens(
            parent, req.all_token_ids[8 * i : 8 * i + 8], b"s" if i == 0 else b""
        )
        assert hashes[i] == parent


def test_incremental_hashing_hashes_each_block_once(monkeypatch):
    calls = []
    real = kv_cache_utils.sha256

    def counting(data):
        calls.append(data)
        return real(data)

    monkeypatch.setattr(kv_cache_utils, "sha256", counting)
    req = make_request(list(range(6)))
    update_block_hashes(req, 4)
    assert len(calls) == 1
    req.append_output_token_ids([6, 7])
    update_block_hashes(req, 4)
    update_block_hashes(req, 4)
    assert len(calls) == 2 and calls[1] == req.block_hashes[0]
