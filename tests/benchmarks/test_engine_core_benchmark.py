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


def test_rounds_need_a_baseline_and_a_bound(tiny_model_dir, capsys):
    with pytest.raises(SystemExit, match="--rounds needs --hf-baseline"):
        engine_core.main(["--model", tiny_model_dir, "--rounds", "2"])
    for hostile in ("0", "21", "x"):
        with pytest.raises(SystemExit):
            engine_core.main(["--model", tiny_model_dir, "--rounds", hostile])
        assert "bad --rounds" in capsys.readouterr().err


def test_rounds_report_each_ratio_and_the_median(tiny_model_dir, tmp_path, capsys,
                                                 monkeypatch):
    bases = iter([10.0, 1e9, 1.0])  # a slow, an impossible and a fast baseline

    def fake_run(model, requests, concurrency, dtype, threads):
        from benchmarks.hf_baseline import static_batch_work

        return {"output_throughput": next(bases), **static_batch_work(requests, concurrency)}

    monkeypatch.setattr(engine_core.hf_baseline, "run", fake_run)
    out = tmp_path / "engine.json"
    code = engine_core.main(["--model", tiny_model_dir, "--num-requests", "3",
                             "--concurrency", "2", "--prompt-len", "4", "--max-tokens-range",
                             "2,6", "--hf-baseline", "--rounds", "3", "--json", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    engine = [r["engine core"]["output_throughput"] for r in payload["rounds"]]
    want = [e / b for e, b in zip(engine, (10.0, 1e9, 1.0), strict=True)]
    assert [r["engine core"] for r in payload["ratios"]] == pytest.approx(want)
    text = capsys.readouterr().out
    assert f"engine core: {sorted(want)[1]:.2f}x transformers generate, median of 3" in text
    assert "static batches: output rows x" in text


def test_two_attention_backends_run_side_by_side(tiny_model_dir, tmp_path):
    out = tmp_path / "engine.json"
    code = engine_core.main(["--model", tiny_model_dir, "--num-requests", "4",
                             "--concurrency", "2", "--prompt-len", "5", "--max-tokens", "3",
                             "--attention-backends", "cpu,torch", "--json", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["engine core (cpu)", "engine core (torch)"]
    assert runs["engine core (cpu)"]["output_tokens"] == runs["engine core (torch)"][
        "output_tokens"] == 12


@pytest.mark.parametrize("hostile", ["flashinfer", "cpu,cpu", "", "cpu,", "CPU", "x" * 300])
def test_attention_backends_outside_the_set_are_refused(tiny_model_dir, hostile, capsys):
    with pytest.raises(SystemExit):
        engine_core.main(["--model", tiny_model_dir, "--attention-backends", hostile])
    assert "bad --attention-backends" in capsys.readouterr().err
