"""What each model family's features cost per step, against Llama's.

    python benchmarks/model_families.py [--families qwen3,gemma2,...] \\
        [--backend cpu|torch] [--threads 1] [--rounds 7] [--decode-iters 3] \\
        [--hidden 512 --intermediate 1536 --layers 8 --heads 8 --kv-heads 4] \\
        [--sliding-window 256] [--experts 4 --top-k 2] [--max-positions 4096] \\
        [--decodes 16 --context 512] [--chunks 256:0,256:256] [--block-size 16] \\
        [--no-pack] [--json benchmarks/results/model_families.json]

For Llama (always run: the baseline) and each family of
kvloom_testing.families.TINY_FAMILIES (default: all) it writes a random
checkpoint with the SAME dims (head_dim = hidden / heads), loads it with
workerd's loader (one process, float32) and sets it up as a CPU worker's
ModelRunner does: the chosen attention backend, the norm and activation ops
on the C kernels exactly when that backend is `cpu`, linear weights packed
for oneDNN (--no-pack: F.linear). It then times two steps over one shared
paged KV cache:

  * decode:  --decodes requests, each one new token over --context cached;
  * prefill: the --chunks (TOKENS:CACHED each; default a 512-token prompt's
             two 256-token chunks, the second over the first's cache).

A sample is model.forward + compute_logits on metadata built once
(kvloom_testing.attention.build_attn_metadata): the plans, rotary tables,
every layer and the LM head, as a served step runs them. Each round visits
every family once (rotating the start), decode then prefill, so machine
noise hits all of them alike; reported: medians over --rounds, and each
family's ratio to Llama's time in the same round (median over rounds).

MoE families keep the active MLP width at --intermediate: Mixtral and
Qwen3-MoE run --top-k of --experts experts of intermediate / top_k each
(every layer sparse), Qwen2-MoE top_k experts plus its shared expert, all of
intermediate / (top_k + 1). Windows are --sliding-window tokens (Gemma 2:
every other layer, Gemma 3: five of six).

What a family adds per step, over Llama's (qkv, rotary, attention, o,
norm, gate_up, SiLU-and-mul, down):

  * qwen2:   q/k/v biases (in the fused qkv matmul): ~free.
  * qwen3:   per-head q/k RMSNorms, two norm ops a layer; with a q/k norm
             the layer rotates q and k in torch (four ops) instead of inside
             the cpu kernel.
  * mistral-window: a window: decodes past it attend only W keys, prefill
             chunks past it fewer, so it can be cheaper than Llama (cpu
             kernel skips the blocks; torch masks the gathered span).
  * gemma2:  sandwich norms (four RMSNorms a layer, two unfused), GELU-tanh
             (no C kernel: torch's gelu + mul), embedding scale, attention
             soft-cap, final logit cap, half the layers windowed. The cap is
             the big one: in the cpu kernel a tanh per query-key score (about
             doubles its prefill attention; benchmarks/attention_kernels.py
             --soft-cap), on the torch backend its explicit path (scores
             materialised by bmm, tanh, softmax: no fused SDPA) instead.
  * gemma3:  Gemma 2's norms and GELU, q/k norms (torch rotary), two rotary
             tables (local and global theta), 5/6 layers windowed, no caps.
  * phi3:    fused qkv / gate_up checkpoint tensors (load-time only, no step
             cost); partial rotary (0.75) with longrope: the kernel only
             rotates full-width NeoX heads, so rotary runs in torch.
  * olmo2:   q/k RMSNorms over all heads (torch rotary), norms after each
             sublayer instead of before (no fused add + norm for those).
  * granite: embedding / residual / attention / logit multipliers: a few
             elementwise ops.
  * smollm3: every fourth layer NoPE (no rotary): ~free or slightly cheaper.
  * glm:     q/k/v biases, partial (0.5) GPT-J-pair rotary in torch.
  * glm4:    GLM's plus norms on the attention and MLP outputs.
  * mixtral, qwen3-moe, qwen2-moe: a router matmul, top-k + softmax,
             sorting tokens by expert and per-expert matmuls (grouped GEMM
             or one small matmul per hit expert) instead of one dense MLP;
             qwen2-moe adds its shared expert and its sigmoid gate. Two
             decode costs beyond that: a batch of 16 hits every one of 4
             experts, so a step reads all the experts' weights (total, not
             active, parameters); expert slices are packed for oneDNN
             only where enough rows reach each expert (packed_linear.py's
             expert_floor), so small batches run them unpacked.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from kvloom_testing.attention import build_attn_metadata  # noqa: E402
from kvloom_testing.checkpoints import make_tiny_llama  # noqa: E402
from kvloom_testing.families import TINY_FAMILIES, make_tiny_checkpoint  # noqa: E402
from workerd.distributed.parallel_state import single_process_state  # noqa: E402
from workerd.layers.attention.backend import make_attention_backend  # noqa: E402
from workerd.layers.custom_op import rank_kernels, use_custom_op_kernels  # noqa: E402
from workerd.layers.packed_linear import pack_linear_weights, packing_unavailable  # noqa: E402
from workerd.models.loader import load_model  # noqa: E402

BASELINE = "llama"
FAMILIES = (BASELINE, *TINY_FAMILIES)
BACKENDS = ("cpu", "torch")


def _chunks(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        if item:
            tokens, cached = item.split(":")
            out.append((int(tokens), int(cached)))
    return out


def family_overrides(family: str, args) -> dict:
    """config.json fields that give `family` the benchmark's dims (beyond
    TINY_FAMILIES' own fields, which stay where these do not replace them)."""
    layers, window, head_dim = args.layers, args.sliding_window, args.hidden // args.heads
    cfg = {"hidden_size": args.hidden, "intermediate_size": args.intermediate,
           "num_hidden_layers": layers, "num_attention_heads": args.heads,
           "num_key_value_heads": args.kv_heads, "head_dim": head_dim,
           "max_position_embeddings": args.max_positions}
    sliding, full = "sliding_attention", "full_attention"
    expert = args.intermediate // args.top_k
    if family in ("mistral-window", "olmo3"):
        cfg["sliding_window"] = window
    elif family == "ministral":
        cfg.update(sliding_window=window,
                   layer_types=[sliding if i % 2 == 0 else full for i in range(layers)])
    elif family == "gemma2":
        cfg.update(sliding_window=window, query_pre_attn_scalar=head_dim,
                   layer_types=[sliding if i % 2 == 0 else full for i in range(layers)],
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    elif family in ("gemma3", "gemma3-multimodal"):  # the wrapper's text_config takes these
        cfg.update(sliding_window=window, query_pre_attn_scalar=head_dim,
                   layer_types=[full if (i + 1) % 6 == 0 else sliding for i in range(layers)])
    elif family == "phi3":
        rotated_pairs = int(head_dim * 0.75) // 2
        cfg.update(original_max_position_embeddings=max(1, args.max_positions // 4),
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.75,
                                    "short_factor": [1.0 + i / rotated_pairs
                                                     for i in range(rotated_pairs)],
                                    "long_factor": [2.0 + 4 * i / rotated_pairs
                                                    for i in range(rotated_pairs)]})
    elif family == "smollm3":
        cfg["no_rope_layers"] = [0 if (i + 1) % 4 == 0 else 1 for i in range(layers)]
    elif family == "mixtral":
        cfg.update(intermediate_size=expert, num_local_experts=args.experts,
                   num_experts_per_tok=args.top_k)
    elif family == "qwen3-moe":
        cfg.update(num_experts=args.experts, num_experts_per_tok=args.top_k,
                   moe_intermediate_size=expert, mlp_only_layers=[])
    elif family == "qwen2-moe":
        width = args.intermediate // (args.top_k + 1)
        cfg.update(num_experts=args.experts, num_experts_per_tok=args.top_k,
                   moe_intermediate_size=width, shared_expert_intermediate_size=width)
    return cfg


def build_checkpoint(root: Path, family: str, args) -> Path:
    path = root / family
    if family == BASELINE:
        return make_tiny_llama(path, num_layers=args.layers, hidden_size=args.hidden,
                               num_heads=args.heads, num_kv_heads=args.kv_heads,
                               intermediate_size=args.intermediate,
                               max_position_embeddings=args.max_positions, seed=args.seed)
    return make_tiny_checkpoint(path, family, seed=args.seed, **family_overrides(family, args))


def load(model_dir: Path, backend: str, pack_rows: int | None):
    """(model, parameters) set up as ModelRunner.load_model sets up a CPU
    float32 rank: the attention backend, the custom ops on the C kernels when
    it is `cpu` (torch code otherwise), and, unless pack_rows is None, the
    linear weights packed for oneDNN (which frees the plain ones: the
    parameters are counted before)."""
    cpu = torch.device("cpu")
    model = load_model(str(model_dir), single_process_state(), torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model.set_attention_backend(make_attention_backend(
        backend, cpu, model.num_kv_heads * model.head_dim))
    use_custom_op_kernels(model, rank_kernels(cpu, torch.float32, backend))
    if pack_rows is not None and packing_unavailable(cpu, torch.float32) is None:
        pack_linear_weights(model, pack_rows)
    return model, params


class Step:
    """One batch (decode or prefill): input ids, positions and metadata built
    once, each request's blocks its own range of the shared cache."""

    def __init__(self, reqs: list[tuple[int, int]], first_block: int, block_size: int,
                 vocab: int, gen: torch.Generator):
        tables, at = [], first_block
        for cached, new in reqs:
            n = -(-(cached + new) // block_size)
            tables.append(list(range(at, at + n)))
            at += n
        self.end_block = at
        self.md, self.positions = build_attn_metadata(
            [c for c, _ in reqs], [n for _, n in reqs], tables, block_size)
        self.input_ids = torch.randint(2, vocab, (self.md.num_actual_tokens,), generator=gen)

    def run(self, model, caches: list[torch.Tensor]) -> torch.Tensor:
        hidden = model(self.input_ids, self.positions, caches, self.md)
        return model.compute_logits(hidden)


def _timed(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def run(args, families: list[str]) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    models, params = {}, {}
    import transformers  # make_tiny_checkpoint's; quiet its progress bars and notes

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="kvloom-families-") as root:
        t0 = time.perf_counter()
        for family in families:
            models[family], params[family] = load(build_checkpoint(Path(root), family, args),
                                                  args.backend,
                                                  args.decodes if args.pack else None)
        build_s = time.perf_counter() - t0
    vocab = min(m.vocab_size for m in models.values())
    decode = Step([(args.context, 1)] * args.decodes, 0, args.block_size, vocab, gen)
    prefill = Step([(c, n) for n, c in args.chunks], decode.end_block, args.block_size,
                   vocab, gen)
    # Every model caches the same shape (same layers, KV heads, head_dim):
    # one cache serves all; its contents change no timing.
    shapes = {m.kv_cache_shape(prefill.end_block, args.block_size) for m in models.values()}
    if len(shapes) != 1:
        raise SystemExit(f"families cache different shapes: {sorted(shapes)}")
    shape = shapes.pop()
    caches = [torch.randn(*shape, generator=gen) for _ in range(args.layers)]
    samples = {f: {"decode": [], "prefill": []} for f in families}
    with torch.inference_mode():
        for model in models.values():  # warm-up: kernels built, allocator primed
            decode.run(model, caches)
            prefill.run(model, caches)
        for r in range(args.rounds):
            start = r % len(families)
            for family in families[start:] + families[:start]:
                model = models[family]
                samples[family]["decode"].append(
                    _timed(lambda m=model: decode.run(m, caches), args.decode_iters))
                samples[family]["prefill"].append(
                    _timed(lambda m=model: prefill.run(m, caches), 1))
    base = samples[BASELINE]
    out = {}
    for family in families:
        s = samples[family]
        row = {"params_m": params[family] / 1e6}
        for what in ("decode", "prefill"):
            row[f"{what}_ms"] = statistics.median(s[what])
            row[f"{what}_ratio"] = statistics.median(
                a / b for a, b in zip(s[what], base[what], strict=True))
            row[f"{what}_samples_ms"] = s[what]
        out[family] = row
    return {"decode_tokens": decode.md.num_actual_tokens,
            "prefill_tokens": prefill.md.num_actual_tokens,
            "build_and_load_s": build_s, "families": out,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "processor": platform.processor() or platform.machine()}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(TINY_FAMILIES),
                   help=f"comma list of {', '.join(FAMILIES)} (llama always runs)")
    p.add_argument("--backend", choices=BACKENDS, default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--decode-iters", type=int, default=3,
                   help="decode steps per sample (a prefill sample is one step)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--sliding-window", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--chunks", type=_chunks, default=[(256, 0), (256, 256)],
                   metavar="TOKENS:CACHED[,...]")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="pack linear weights for oneDNN as a CPU float32 worker does")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    return p


def check_args(args) -> list[str]:
    """The families to run, llama first; SystemExit naming a bad flag."""
    for name in ("threads", "rounds", "decode_iters", "hidden", "intermediate", "layers",
                 "heads", "kv_heads", "sliding_window", "experts", "top_k", "block_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise SystemExit("--hidden must divide by --heads, and --heads by --kv-heads")
    if args.top_k > args.experts or args.intermediate < args.top_k + 1:
        raise SystemExit("--top-k must be <= --experts and < --intermediate")
    if args.decodes < 1 or args.context < 0 or not args.chunks or any(
            n < 1 or c < 0 for n, c in args.chunks):
        raise SystemExit("--decodes >= 1, --context >= 0 and --chunks of TOKENS >= 1 needed")
    longest = max(args.context + 1, *(n + c for n, c in args.chunks))
    if longest > args.max_positions:
        raise SystemExit(f"a request reaches {longest} tokens > --max-positions")
    names = [f for f in args.families.split(",") if f]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    return [BASELINE] + [f for f in dict.fromkeys(names) if f != BASELINE]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    families = check_args(args)
    torch.set_num_threads(args.threads)
    result = run(args, families)
    print(f"{args.backend} backend, {args.threads} thread(s), {args.layers} layers x "
          f"{args.hidden} hidden; decode: {result['decode_tokens']} requests at context "
          f"{args.context}; prefill: {result['prefill_tokens']} tokens "
          f"({args.chunks}); medians of {args.rounds} rounds")
    width = max(len(f) for f in ("family", *result["families"]))
    print(f"{'family':<{width}} {'params M':>8} {'decode ms':>10} {'x llama':>8} "
          f"{'prefill ms':>11} {'x llama':>8}")
    for family, row in result["families"].items():
        print(f"{family:<{width}} {row['params_m']:>8.1f} {row['decode_ms']:>10.2f} "
              f"{row['decode_ratio']:>8.2f} {row['prefill_ms']:>11.1f} "
              f"{row['prefill_ratio']:>8.2f}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config["families"] = families
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": config, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
