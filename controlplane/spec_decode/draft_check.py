"""Whether a checkpoint can draft for the served model: a draft model's
tokens are verified as the target's own ids, so both must read the same
vocabulary through the same tokenizer; anything else is refused at start-up
with what differs."""

from __future__ import annotations

import os


def draft_model_problem(draft_path: str, target_path: str, target_vocab_size: int) -> str | None:
    """What makes draft_path unfit to draft for target_path, or None."""
    from controlplane.model_info import read_model_info

    if not os.path.isfile(os.path.join(draft_path, "config.json")):
        return "not a checkpoint directory (no config.json)"
    try:
        draft = read_model_info(draft_path)
    except (OSError, ValueError, KeyError) as exc:
        return str(exc)
    if draft.vocab_size != target_vocab_size:
        return (f"its vocabulary has {draft.vocab_size} ids, the served model's "
                f"{target_vocab_size}: a draft model must share the target's tokenizer")
    from transformers import AutoTokenizer

    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_path)
        target_tok = AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        return f"its tokenizer cannot be loaded: {exc}"
    if draft_tok.get_vocab() != target_tok.get_vocab():
        return "its tokenizer's vocabulary differs from the served model's"
    return None
