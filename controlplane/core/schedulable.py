"""Whether a request could ever be scheduled: the scheduler's last check on
admission (the API edge validates first), with a message that says what to
change. Kept apart from the per-step policy in scheduler.py."""

from __future__ import annotations

from controlplane.config import SchedulerConfig
from controlplane.core.kv_cache_manager import KVCacheManager
from controlplane.core.kv_cache_utils import max_num_computed_tokens
from controlplane.core.request import Request, exceeds_max_model_len


def check_schedulable(request: Request, cfg: SchedulerConfig, kv: KVCacheManager) -> None:
    """Raises ValueError naming the limit a request can never fit."""
    req_id = request.request_id
    num_prompt = request.num_prompt_tokens
    max_tokens = request.max_tokens
    if num_prompt == 0:
        raise ValueError(f"request {req_id!r} has an empty prompt")
    if max_tokens < 1:
        raise ValueError(f"request {req_id!r}: max_tokens must be >= 1, got {max_tokens}")
    if exceeds_max_model_len(num_prompt, max_tokens, cfg.max_model_len):
        raise ValueError(
            f"request {req_id!r}: prompt ({num_prompt} tokens) + max_tokens "
            f"({max_tokens}) exceeds max_model_len ({cfg.max_model_len})"
        )
    num_blocks = kv.blocks_needed(num_prompt, max_tokens)
    if num_blocks > kv.num_total_blocks:
        raise ValueError(
            f"request {req_id!r} needs {num_blocks} KV blocks but the pool "
            f"has only {kv.num_total_blocks}; it could never be scheduled"
        )
    num_computed_at_most = max_num_computed_tokens(num_prompt, max_tokens)
    if not cfg.enable_chunked_prefill and num_computed_at_most > cfg.max_num_batched_tokens:
        # Without chunking a (re)computed sequence must fit one step's budget.
        raise ValueError(
            f"request {req_id!r}: prompt + max_tokens exceeds max_num_batched_tokens "
            f"({cfg.max_num_batched_tokens}) and chunked prefill is disabled"
        )
