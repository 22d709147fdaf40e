"""Multi-LoRA in process: the real Scheduler and EngineCore over a real
workerd Worker (both wire modules), against transformers + PeftModel.

Base and adapter requests share one batch with --max-loras below the
adapters in flight (the gate makes some wait their turn); each adapter
changes PeftModel's own greedy tokens (the negative control), so a rank that
ignored an adapter, or added one to a base row, fails here.
"""

from __future__ import annotations

import pytest

from controlplane.lora.names import LoRARequest
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.inprocess import InProcessExecutor, make_engine
from kvloom_testing.lora import make_peft_adapter, peft_greedy
from tests.controlplane.core.helpers import make_request
from tests.controlplane.engine.test_engine import Client, IdleProbe, _prompt

MAX_LORAS = 1
ADAPTERS = {  # name -> (seed, r, targets, rsLoRA)
    "all16": (11, 16, "all-linear", False),
    "attn4": (12, 4, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp8rs": (13, 8, ["gate_proj", "up_proj", "down_proj"], True),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_peft_adapter(tiny_model_dir, root / name, seed=seed, r=r,
                                        target_modules=targets, use_rslora=rs))
            for name, (seed, r, targets, rs) in ADAPTERS.items()}


class LoRARun:
    """An engine on its thread over a fresh worker with LoRA on."""

    def __init__(self, model_dir: str, *, async_scheduling: bool = True, num_blocks: int = 64,
                 **overrides):
        self.executor = InProcessExecutor(
            model_dir, num_gpu_blocks=num_blocks,
            lora=worker_pb2.LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=16, max_cpu_loras=4))
        self.client = Client()
        self.engine = make_engine(self.executor, self.client.emit,
                                  async_scheduling=async_scheduling, max_loras=MAX_LORAS,
                                  **overrides)
        self.engine.input_queue = IdleProbe(self.engine)
        self.num_blocks = num_blocks
        self.engine.start()
        self.engine.group_ready(self.executor.num_gpu_blocks)
        self.engine.input_queue.wait_idle(2)
        self.next_id = 1

    def load(self, name: str, path: str) -> LoRARequest:
        """LoadLoRA between steps, as the controlplane sends it."""
        self.engine.input_queue.wait_blocked()
        lora_id, self.next_id = self.next_id, self.next_id + 1
        reply = self.executor.call(load_lora=worker_pb2.LoadLoRA(
            lora_id=lora_id, lora_name=name, lora_path=path)).lora_loaded
        assert not reply.error, reply.error
        return LoRARequest(name, lora_id, reply.digest)

    def remove(self, lora: LoRARequest) -> None:
        self.engine.input_queue.wait_blocked()
        self.executor.call(remove_lora=worker_pb2.RemoveLoRA(lora_id=lora.lora_id))

    def run(self, requests) -> dict[str, list[int]]:
        for request in requests:
            self.engine.add_request(request)
        self.client.wait_finished(*(r.request_id for r in requests))
        return {r.request_id: self.client.tokens(r.request_id) for r in requests}

    def close(self) -> None:
        self.client.resume()
        self.engine.shutdown()
        self.executor.close()


@pytest.fixture
def lora_run(tiny_model_dir):
    run = LoRARun(tiny_model_dir)
    yield run
    run.close()


def _request(i: int, lora: LoRARequest | None, max_tokens: int = 8, n: int = 9):
    request = make_request(_prompt(n + i, 60 + i), max_tokens=max_tokens, req_id=f"q{i}",
                           temperature=0.0, ignore_eos=True)
    request.lora = lora
    return request


def test_mixed_batch_matches_peft_with_fewer_slots_than_adapters(lora_run, tiny_model_dir,
                                                                  adapters):
    loras = [lora_run.load(name, path) for name, path in adapters.items()]
    plan = [None, loras[0], loras[1], None, loras[2], loras[0], loras[1], loras[2]]
    requests = [_request(i, lora, max_tokens=6 + i % 3) for i, lora in enumerate(plan)]
    got = lora_run.run(requests)
    for request, lora in zip(requests, plan, strict=True):
        path = adapters[lora.lora_name] if lora is not None else None
        want = peft_greedy(tiny_model_dir, path, request.prompt_token_ids, request.max_tokens)
        assert got[request.request_id] == want, (request.request_id, lora)
        if lora is not None:  # the negative control: the adapter changes the tokens
            base = peft_greedy(tiny_model_dir, None, request.prompt_token_ids,
                               request.max_tokens)
            assert want != base, lora.lora_name


def test_a_reload_with_other_weights_never_reuses_the_old_kv(lora_run, tiny_model_dir,
                                                              adapters, tmp_path):
    prompt_request = _request(0, None, max_tokens=4, n=40)
    prompt = prompt_request.prompt_token_ids
    first = lora_run.load("a", adapters["all16"])
    r1 = make_request(list(prompt), max_tokens=4, req_id="v1", temperature=0.0,
                      ignore_eos=True)
    r1.lora = first
    lora_run.run([r1])
    lora_run.remove(first)
    # The same name, other weights: a new version; the prompt's blocks are
    # cached under the old one and must not be hit.
    second = lora_run.load("a", adapters["attn4"])
    assert second.version != first.version
    r2 = make_request(list(prompt), max_tokens=4, req_id="v2", temperature=0.0,
                      ignore_eos=True)
    r2.lora = second
    got = lora_run.run([r2])
    assert got["v2"] == peft_greedy(tiny_model_dir, adapters["attn4"], prompt, 4)
    assert lora_run.client.final("v2").num_cached_tokens == 0


def test_remove_lora_frees_the_adapter_once_its_last_request_ended(lora_run, tiny_model_dir,
                                                                   adapters):
    lora = lora_run.load("x", adapters["all16"])
    manager = lora_run.executor.runner.lora.manager
    request = _request(3, lora, max_tokens=12)
    lora_run.engine.add_request(request)
    # The controlplane sends RemoveLoRA once no unfinished request names the
    # adapter; this rank may still hold the finished request's state (its
    # end reaches the workers with the next step): the adapter goes at once.
    lora_run.client.wait_finished(request.request_id)
    lora_run.remove(lora)
    assert lora.lora_id not in manager.adapter_ids()
    follow = _request(4, None, max_tokens=2)
    lora_run.run([follow])  # the next step drops the finished request's state
    assert lora_run.executor.runner.requests == {}
    assert lora_run.client.tokens(request.request_id) == peft_greedy(
        tiny_model_dir, adapters["all16"], request.prompt_token_ids, 12)


def test_preempted_adapter_requests_resume_exactly(tiny_model_dir, adapters):
    # A pool too small for the batch: requests are preempted (recomputed
    # from their tokens) with their adapters, and must come back exact.
    run = LoRARun(tiny_model_dir, num_blocks=14, max_num_batched_tokens=32)
    try:
        loras = [run.load(name, path) for name, path in adapters.items()]
        plan = [loras[0], None, loras[1], loras[2], loras[0], None]
        requests = [_request(i, lora, max_tokens=20, n=14) for i, lora in enumerate(plan)]
        got = run.run(requests)
        assert run.engine.scheduler.num_preemptions > 0
        for request, lora in zip(requests, plan, strict=True):
            path = adapters[lora.lora_name] if lora is not None else None
            assert got[request.request_id] == peft_greedy(
                tiny_model_dir, path, request.prompt_token_ids, request.max_tokens)
    finally:
        run.close()
