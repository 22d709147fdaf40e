"""benchmarks/engine_core.py: it must run serving.py's very requests (same
seeds, same flags), count every output token, and keep at most
--concurrency requests in flight; bad sizes are refused."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_core, serving
from controlplane.model_info import read_model_info


def test_same_requests_as_the_serving_benchmark(tiny_model_dir):
    flags = ["--num-requests", "5", "--prompt-len-range", "3,9", "--max-tokens-range", "2,6",
             "--seed", "3"]
    ours = engine_core.build_parser().parse_args(["--model", tiny_model_dir, *flags])
    theirs = serving.build_parser().parse_args(flags)
    info = read_model_info(tiny_model_dir)
    prompts = serving.random_prompts(info.vocab_size, info.eos_token_ids, ours)
    assert prompts == serving.random_prompts(info.vocab_size, info.eos_token_ids, theirs)
    assert [len(p) for p in prompts] != [len(prompts[0])] * 5  # the range was used
    assert not set().union(*prompts) & set(info.eos_token_ids)
    assert serving.output_lengths(ours) == serving.output_lengths(theirs)


def test_run_counts_every_token_within_the_concurrency(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    code = engine_core.main(["--model", tiny_model_dir, "--num-requests", "6",
                             "--concurrency", "2", "--prompt-len-range", "3,9",
                             "--max-tokens-range", "2,7", "--json", str(out)])
    assert code == 0
    run = json.loads(out.read_text())["runs"]["engine core"]
    args = engine_core.build_parser().parse_args(["--num-requests", "6",
                                                  "--max-tokens-range", "2,7"])
    assert run["completed"] == 6
    assert run["output_tokens"] == sum(serving.output_lengths(args))
    # Two in flight: no step can sample more than two tokens.
    assert run["tokens_per_step"] <= 2
    assert run["output_throughput"] == pytest.approx(run["output_tokens"] / run["duration_s"])
    assert "output tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--concurrency", "--num-requests", "--threads",
                                  "--max-num-batched-tokens", "--prompt-len", "--max-tokens"])
def test_sizes_below_one_are_refused(tiny_model_dir, flag):
    with pytest.raises(SystemExit, match=f"{flag} must be >= 1"):
        engine_core.main(["--model", tiny_model_dir, flag, "0"])
