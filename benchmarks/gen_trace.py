"""Synthetic request traces for benchmarks/scheduler_replay.py.

Kinds:
  uniform        prompts of 128-2048 random tokens, nothing shared;
  shared-prefix  80% of requests open with one 512-token system prompt,
                 followed by 128-1536 random tokens (exercises the prefix cache).
Token ids are drawn from [100, 50000) so they never collide with special ids.
"""

from __future__ import annotations

import argparse
import json
import random

TOKEN_LO, TOKEN_HI = 100, 50000
SYSTEM_PROMPT_LEN = 512
SHARED_FRACTION = 0.8


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def gen_trace(
    kind: str, num_requests: int, seed: int, max_tokens: int = 128, arrival_steps: int = 0
) -> dict:
    rng = random.Random(seed)
    system_prompt = _tokens(rng, SYSTEM_PROMPT_LEN)
    requests = []
    for i in range(num_requests):
        if kind == "uniform":
            prompt = _tokens(rng, rng.randint(128, 2048))
        elif kind == "shared-prefix":
            tail = _tokens(rng, rng.randint(128, 2048 - SYSTEM_PROMPT_LEN))
            prompt = system_prompt + tail if rng.random() < SHARED_FRACTION else tail
        else:
            raise ValueError(f"unknown trace kind {kind!r}")
        requests.append(
            {
                "request_id": f"req-{i}",
                "arrival_step": rng.randint(0, arrival_steps) if arrival_steps else 0,
                "prompt_token_ids": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
        )
    meta = {"kind": kind, "num_requests": num_requests, "seed": seed, "max_tokens": max_tokens}
    return {"meta": meta, "requests": requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("uniform", "shared-prefix"), default="uniform")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--arrival-steps", type=int, default=0, help="spread arrivals over steps [0, N]; 0 = all"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    trace = gen_trace(args.kind, args.num_requests, args.seed, args.max_tokens, args.arrival_steps)
    with open(args.out, "w") as f:
        json.dump(trace, f)


if __name__ == "__main__":
    main()
