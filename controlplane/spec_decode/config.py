"""--speculative-config: vLLM's JSON for speculative decoding.

`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}` proposes drafts by prompt lookup (ngram.py) in the
controlplane; `{"method": "draft_model", "num_speculative_tokens": K,
"model": DIR}` proposes them with a small model of the target's family, from
a local directory, on the workers of the last stage. As in vLLM, when both
prompt_lookup_min and prompt_lookup_max are omitted they are 5, and when one
is given the other mirrors it; a JSON null is the same as an omitted key.

Every key is checked here once, at start-up: an unknown key, a wrong JSON
type (a bool is not an int, nor is 4.0), a key of the other method, or a
value out of its bounds is refused with a message naming the key, so a typo
never silently turns speculation off or changes what it does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)
MAX_CONFIG_BYTES = 4096
# K: drafts verified per request per step; each one is a token of the step's
# budget and a row of logits.
MAX_SPEC_TOKENS = 16
# The longest suffix n-gram looked up (vLLM's prompt_lookup_max).
MAX_LOOKUP = 32
# vLLM's prompt_lookup_min = prompt_lookup_max when both are omitted.
DEFAULT_LOOKUP = 5
MAX_MODEL_PATH = 4096
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
_FLAG = "--speculative-config"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    # "ngram" or "draft_model".
    method: str
    # K, the drafts proposed per request per step (at most; n-gram drafts
    # may be shorter).
    num_speculative_tokens: int
    # ngram only: suffix n-gram lengths looked up, longest first.
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    # draft_model only: the draft model's local directory.
    model: str | None = None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's value. Raises ValueError naming the key at fault and what
    it must be."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{_FLAG} is {size} bytes; at most {MAX_CONFIG_BYTES}")
    if not text.strip():
        raise ValueError(f"{_FLAG} is empty; give a JSON object such as "
                         '{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError(f"{_FLAG} is nested too deeply; it must be a flat JSON object") from None
    except ValueError as exc:
        raise ValueError(f"{_FLAG} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{_FLAG} must be a JSON object")
    unknown = sorted(set(obj) - set(_KEYS))
    if unknown:
        raise ValueError(f"{_FLAG}: unknown key(s) {unknown}; known: {list(_KEYS)}")
    method = obj.get("method")
    if not isinstance(method, str) or method not in METHODS:
        what = "is required" if method is None else f"is {method!r:.80}"
        raise ValueError(f"{_FLAG}: method {what}; one of {list(METHODS)}")
    k = obj.get("num_speculative_tokens")
    if k is None:
        raise ValueError(f"{_FLAG}: num_speculative_tokens is required; an integer in "
                         f"[1, {MAX_SPEC_TOKENS}]")
    k = _int(obj, "num_speculative_tokens", MAX_SPEC_TOKENS)
    given = {key for key, value in obj.items() if value is not None}
    if method == NGRAM:
        if "model" in given:
            raise ValueError(f"{_FLAG}: model is for method \"draft_model\"; method "
                             f"\"ngram\" needs no model (remove the key)")
        low = _int(obj, "prompt_lookup_min", MAX_LOOKUP) if "prompt_lookup_min" in given else None
        high = _int(obj, "prompt_lookup_max", MAX_LOOKUP) if "prompt_lookup_max" in given else None
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        if low > high:
            raise ValueError(f"{_FLAG}: prompt_lookup_min ({low}) must be at most "
                             f"prompt_lookup_max ({high})")
        return SpeculativeConfig(method, k, prompt_lookup_min=low, prompt_lookup_max=high)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in given:
            raise ValueError(f"{_FLAG}: {key} is for method \"ngram\"; method "
                             f"\"draft_model\" does not look up n-grams (remove the key)")
    model = obj.get("model")
    if model is None:
        raise ValueError(f"{_FLAG}: model is required for method \"draft_model\": the draft "
                         f"model's local directory")
    if (not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_PATH
            or "\x00" in model):
        raise ValueError(f"{_FLAG}: model must be the draft model's local directory, a "
                         f"non-empty path of at most {MAX_MODEL_PATH} characters, got "
                         f"{model!r:.80}")
    return SpeculativeConfig(method, k, model=model)


def _int(obj: dict, key: str, high: int) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{_FLAG}: {key} must be an integer in [1, {high}], got {value!r:.80}")
    return value


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            # json.loads would keep the last silently; a repeated key is a
            # mistake in one of its two places.
            raise ValueError(f"key {key!r:.80} appears twice")
        obj[key] = value
    return obj
