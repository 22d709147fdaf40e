"""Random programs through a pipelined engine and a real worker.

Requests arrive and are aborted at random points while steps are in flight.
A tight KV pool forces preemptions with placeholders outstanding, and
priority mode preempts requests that were scheduled earlier in the same step.
The engine runs synchronously on the test thread: EngineCore with async
scheduling, and InProcessExecutor with a real workerd ModelRunner over
SlotProbeModel, which writes each input token into its KV slot and always
samples PROBE_TOKEN.

After every engine pass:
* the block pool is consistent;
* the worker's tokens for each live request are the controlplane's tokens plus
  one PROBE_TOKEN per placeholder (the worker has run every step in flight);
* the worker's KV holds the right token at every computed position.

At the end every request has finished exactly once, and no output came after
its finish. A request that was not aborted has exactly max_tokens tokens. Every
block is free and the worker holds no request.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.request import FinishReason
from kvloom_testing.inprocess import InProcessExecutor, make_engine
from kvloom_testing.slot_probe import SlotProbeModel
from tests.controlplane.core.helpers import check_pool, make_request

PROBE = SlotProbeModel.PROBE_TOKEN

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 10), st.integers(0, 2)),
        st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 10), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=6,
    max_size=40,
)
_configs = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 14),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(8, 32),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "enable_prefix_caching": st.booleans(),
})


class Program:
    def __init__(self, config: dict) -> None:
        num_blocks = config.pop("num_blocks")
        caching = config.pop("enable_prefix_caching")
        self.executor = InProcessExecutor(SlotProbeModel(), num_gpu_blocks=num_blocks)
        self.outputs: dict[str, list] = {}
        self.finished: dict[str, object] = {}
        self.max_tokens: dict[str, int] = {}
        self.engine = make_engine(self.executor, self._emit, enable_prefix_caching=caching,
                                  max_model_len=40, async_scheduling=True, **config)
        self.engine.group_ready(self.executor.num_gpu_blocks)
        self._pump()
        self.next_id = 0

    def _emit(self, outputs, record) -> None:
        for out in outputs:
            assert out.request_id not in self.finished, f"output after {out.request_id} finished"
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = out.finish_reason

    def _pump(self) -> None:
        queue = self.engine.input_queue
        while not queue.empty():
            self.engine._handle_safely(*queue.get_nowait())

    def add(self, length: int, max_tokens: int, priority: int) -> None:
        req_id = f"p{self.next_id}"
        # Shared prefixes, so prefix-cache hits meet placeholders too.
        prompt = [100 + (i % 7) for i in range(length // 2)] + [
            300 + self.next_id * 40 + i for i in range(length - length // 2)]
        self.next_id += 1
        self.max_tokens[req_id] = max_tokens
        self.engine.add_request(make_request(prompt, max_tokens, req_id, priority,
                                             temperature=0.0, ignore_eos=True))

    def abort(self, index: int) -> None:
        live = [r for r in self.max_tokens if r not in self.finished]
        if live:
            self.engine.abort_requests([live[index % len(live)]])

    def step(self, times: int) -> None:
        for _ in range(times):
            self._pump()
            if self.engine._has_work():
                self.engine.step()
            self.check()

    def check(self) -> None:
        sched = self.engine.scheduler
        check_pool(sched)
        runner = self.executor.runner
        kv = runner.kv_caches[0].view(-1)
        bs = sched.block_size
        for req_id, req in sched.requests.items():
            state = runner.requests.get(req_id)
            if state is None:
                assert not sched.worker_requests.holds(req), req_id
                continue
            assert state.all_token_ids == (
                req.all_token_ids + [PROBE] * req.num_output_placeholders), req_id
            if req in sched.running:
                blocks = sched.kv_cache_manager.get_block_ids(req_id)
                computed = req.num_computed_tokens
                slots = [blocks[p // bs] * bs + p % bs for p in range(computed)]
                assert kv[slots].long().tolist() == state.all_token_ids[:computed], req_id

    def drain(self) -> None:
        for _ in range(2000):
            self._pump()
            if not self.engine._has_work():
                break
            self.engine.step()
            self.check()
        assert not self.engine._has_work()

    def check_end(self) -> None:
        assert set(self.finished) == set(self.max_tokens)
        for req_id, reason in self.finished.items():
            tokens = self.outputs.get(req_id, [])
            assert set(tokens) <= {PROBE}
            if reason is FinishReason.ABORT:
                assert len(tokens) <= self.max_tokens[req_id]
            else:
                assert reason is FinishReason.LENGTH, (req_id, reason)
                assert len(tokens) == self.max_tokens[req_id], req_id
        sched = self.engine.scheduler
        assert sched.kv_cache_manager.get_num_free_blocks() == sched.num_gpu_blocks
        assert self.executor.runner.requests == {}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=_configs, ops=_ops)
def test_random_programs_under_async_scheduling(config, ops):
    program = Program(dict(config))
    try:
        for op in ops:
            getattr(program, op[0])(*op[1:])
        program.drain()
        program.check_end()
    finally:
        program.executor.close()
