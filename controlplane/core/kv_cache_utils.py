"""Block hashes for prefix caching: the identity of a full KV block.

A full block's hash covers its parent's hash, its own token ids and extra keys
(the request's cache_salt on the first block). Because the parent is folded in,
equal hashes mean equal token prefixes, so the KVCacheManager can reuse the KV
of any cached block whose hash a new request's prompt reproduces.

Hash choice: SHA-256 over the parent digest plus the tokens packed as uint32.
Python's hash() would be cheaper, but it is 64-bit and easy to collide on
purpose (ints hash to themselves mod 2**61-1), and a collision makes one request
read another tenant's KV. SHA-256 is cheap next to a step (docs/benchmarks.md,
"Scheduler"), and each full block is hashed once in its request's life (see
update_block_hashes), so it stays off the per-step hot path.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import sha256

from controlplane.config import SchedulerConfig
from controlplane.core.request import Request

# The parent "hash" of a request's first block.
NONE_HASH = b"\x00" * 32


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: bytes = b""
) -> bytes:
    """Digest of one full block. extra_keys is length-prefixed so that salt
    bytes can never be mistaken for token bytes."""
    h = sha256(parent_hash)
    h.update(array("I", token_ids).tobytes())
    if extra_keys:
        h.update(len(extra_keys).to_bytes(4, "little"))
        h.update(extra_keys)
    return h.digest()


def _first_block_extra_keys(request: Request) -> bytes:
    """The cache salt and the LoRA adapter's version. The first block is
    enough: every later block's hash folds in its parent's, so an adapter
    (or salt) that differs makes every block of the request differ. The
    version is the digest of the adapter's files, not its name: a reload
    under the same name with other weights must not reuse the old KV."""
    salt = request.cache_salt
    extra = salt.encode() if salt else b""
    if request.lora is not None:
        # Length-prefixed, so no salt can spell an adapter's key.
        extra = len(extra).to_bytes(4, "little") + extra + b"lora:" + \
            request.lora.version.encode()
    return extra


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend request.block_hashes to every full block of all_token_ids.

    Incremental: only blocks that became full since the last call are hashed,
    so calling this every step costs O(new full blocks), not O(sequence).
    The new blocks' tokens are packed in one array call and sliced per block,
    giving the same digests as hash_block_tokens at half the cost.
    """
    hashes = request.block_hashes
    token_ids = request.all_token_ids
    num_full = len(token_ids) // block_size
    start = len(hashes)
    if start >= num_full:
        return hashes
    packed = array("I", token_ids[start * block_size : num_full * block_size]).tobytes()
    stride = 4 * block_size
    parent = hashes[-1] if hashes else NONE_HASH
    offset = 0
    if start == 0:
        extra = _first_block_extra_keys(request)
        parent = hash_block_tokens(parent, token_ids[:block_size], extra)
        hashes.append(parent)
        offset = stride
    append = hashes.append
    for begin in range(offset, len(packed), stride):
        h = sha256(parent)
        h.update(packed[begin : begin + stride])
        parent = h.digest()
        append(parent)
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_num_computed_tokens(num_prompt_tokens: int, max_tokens: int) -> int:
    """Most tokens a request ever runs through the model (and so writes KV for)."""
    # The last sampled token is never fed back to the model, so it needs no
    # KV slot and no place in a step's token budget.
    return num_prompt_tokens + max_tokens - 1


def max_step_tokens(config: SchedulerConfig) -> int:
    """Most tokens one request computes in one step (the scheduler caps each
    request's chunk at the threshold, then at the step's budget)."""
    threshold, budget = config.long_prefill_token_threshold, config.max_num_batched_tokens
    return threshold if 0 < threshold < budget else budget


def blocks_needed(
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    sliding_window: int | None = None,
    step_tokens: int = 0,
) -> int:
    """KV blocks a request holds at its peak. The API edge and the
    scheduler both admit with this, so the edge never refuses what fits.

    With a window every layer slides by (KVCacheManager frees what left it),
    a step starting at c with n <= step_tokens tokens holds only the blocks
    of tokens c - W + 1 .. c + n - 1: W - 1 + n tokens, which straddle at
    most (W + n - 3) // block_size + 2 blocks; never more than the whole
    context's. step_tokens 0 (not known) earns no credit for the window."""
    whole = cdiv(max_num_computed_tokens(num_prompt_tokens, max_tokens), block_size)
    if sliding_window is None or step_tokens <= 0:
        return whole
    span = sliding_window - 1 + step_tokens
    return min(whole, (span + block_size - 2) // block_size + 1)
