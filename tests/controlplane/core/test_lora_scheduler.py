"""The scheduler's half of multi-LoRA: --max-loras distinct adapters per step
(waiting requests over the cap skipped, not blocking; running ones too),
adapter ids on the new requests' diff, and the prefix cache keyed on the
adapter's version, never its name."""

from __future__ import annotations

from controlplane.core.kv_cache_utils import update_block_hashes
from controlplane.lora.names import LoRARequest
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request, model_output, step

A = LoRARequest("a", 1, "v-a")
B = LoRARequest("b", 2, "v-b")
C = LoRARequest("c", 3, "v-c")


def _req(lora, prompt=8, **kw):
    request = make_request(prompt, max_tokens=kw.pop("max_tokens", 4), **kw)
    request.lora = lora
    return request


def _adapters(sched, so) -> set[int]:
    ids = set()
    for req_id in so.num_scheduled_tokens:
        lora = sched.get_request(req_id).lora
        if lora is not None:
            ids.add(lora.lora_id)
    return ids


def _step(sched):
    """One step: (the adapters it ran, its outputs)."""
    so = sched.schedule()
    ran = _adapters(sched, so)
    return ran, sched.update_from_output(so, model_output(sched, so))


def test_waiting_request_over_the_cap_is_skipped_not_blocking():
    sched = make_scheduler(max_loras=1)
    first, blocked, base, same = _req(A), _req(B), _req(None), _req(A)
    for r in (first, blocked, base, same):
        sched.add_request(r)
    so = sched.schedule()
    # b would be the second adapter: it waits; the base and a's second go ahead of it.
    assert set(so.num_scheduled_tokens) == {first.request_id, base.request_id, same.request_id}
    assert [r.request_id for r in sched.waiting] == [blocked.request_id]
    assert {n.req_id: n.lora_id for n in so.scheduled_new_reqs} == {
        first.request_id: 1, base.request_id: 0, same.request_id: 1}


def test_every_step_stays_under_the_cap_until_all_finish():
    sched = make_scheduler(max_loras=2)
    requests = [_req(lora, max_tokens=3 + i) for i, lora in
                enumerate([A, B, C, A, None, C, B, C])]
    for r in requests:
        sched.add_request(r)
    seen = set()
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        ran, outs = _step(sched)
        assert len(ran) <= 2
        seen |= {o.request_id for o in outs if o.finished}
    assert seen == {r.request_id for r in requests}


def test_running_request_sits_out_a_step_whose_cap_is_full():
    # a runs; while it sits out a step (budget spent), b is admitted; the
    # next step must not run both.
    sched = make_scheduler(max_loras=1, max_num_batched_tokens=8)
    ra = _req(A, prompt=8, max_tokens=6)
    sched.add_request(ra)
    step(sched)  # ra prefilled
    rb = _req(B, prompt=4, max_tokens=6)
    sched.add_request(rb)
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        ran, _ = _step(sched)
        assert len(ran) <= 1


def test_block_hashes_key_on_the_version_not_the_name():
    tokens = list(range(100, 116))
    plain = _req(None, prompt=list(tokens))
    a1 = _req(LoRARequest("a", 1, "digest-1"), prompt=list(tokens))
    a1_again = _req(LoRARequest("a", 7, "digest-1"), prompt=list(tokens))
    a2 = _req(LoRARequest("a", 8, "digest-2"), prompt=list(tokens))
    b1 = _req(LoRARequest("b", 9, "digest-1"), prompt=list(tokens))
    h = {name: update_block_hashes(r, 4) for name, r in
         (("plain", plain), ("a1", a1), ("a1_again", a1_again), ("a2", a2), ("b1", b1))}
    # The same weights (one digest) share KV whatever the name or load id.
    assert h["a1"] == h["a1_again"] == h["b1"]
    # Other weights under the same name, or none: every block differs.
    for other in ("plain", "a2"):
        assert all(x != y for x, y in zip(h["a1"], h[other], strict=True))


def test_a_reloaded_adapter_gets_no_prefix_hit_from_the_old_weights():
    sched = make_scheduler(max_loras=2)
    prompt = list(range(200, 224))
    old = _req(LoRARequest("a", 1, "digest-old"), prompt=list(prompt), max_tokens=1)
    sched.add_request(old)
    while sched.has_unfinished_requests():
        step(sched)
    new = _req(LoRARequest("a", 2, "digest-new"), prompt=list(prompt), max_tokens=1)
    same = _req(LoRARequest("a", 3, "digest-old"), prompt=list(prompt), max_tokens=1)
    sched.add_request(new)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    sched.add_request(same)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20  # 5 full blocks of 4 - 1 token


def test_stats_count_running_and_waiting_per_adapter():
    sched = make_scheduler(max_loras=1)
    for lora in (A, A, B, None):
        sched.add_request(_req(lora))
    sched.schedule()
    stats = sched.make_stats()
    assert stats.max_loras == 1
    assert stats.running_lora_adapters == (("a", 2),)
    assert stats.waiting_lora_adapters == (("b", 1),)


def test_kv_events_name_the_adapter_of_the_blocks():
    from controlplane.api.vllm_engine.kv_events import batch_to_proto
    from controlplane.core.kv_events import BlockStored

    sched = make_scheduler(enable_kv_cache_events=True, block_size=4, max_loras=2)
    prompt = list(range(400, 409))
    for req_id, lora in (("p", None), ("l", A)):
        request = _req(lora, prompt=list(prompt), max_tokens=1, req_id=req_id)
        sched.add_request(request)
        step(sched)
    events = [e for e in sched.kv_cache_manager.take_events() if isinstance(e, BlockStored)]
    assert [e.lora_name for e in events] == ["", "a"]
    assert events[0].token_ids == events[1].token_ids  # same tokens, other blocks
    assert events[0].block_hashes != events[1].block_hashes
    batch = batch_to_proto(1, events, 0, 0.0)
    assert [e.stored.lora_name for e in batch.events] == ["", "a"]
