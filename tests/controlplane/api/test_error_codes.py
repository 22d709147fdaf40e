"""Engine error codes are an enum in the core and become gRPC statuses only at
the API edge, through a mapping that covers every code: a code the edge does
not know fails here, not silently as INTERNAL in production."""

from __future__ import annotations

import grpc
import pytest

from controlplane.api.generation_service import GRPC_STATUS, _status
from controlplane.config import CacheConfig, SchedulerConfig
from controlplane.core.outputs import EngineErrorCode
from controlplane.core.request import FinishReason, Request, SamplingParams
from controlplane.core.scheduler import Scheduler
from controlplane.engine.core import EngineCore
from controlplane.executor.step_executor import StepExecutor


def test_every_engine_error_code_maps_to_a_grpc_status():
    assert set(GRPC_STATUS) == set(EngineErrorCode)
    for code in EngineErrorCode:
        status = _status(code)
        assert isinstance(status, grpc.StatusCode)
        # The codes are named after what the client sees; keep them aligned.
        assert status.name == code.name


def test_a_code_name_string_is_not_a_code():
    with pytest.raises(KeyError):
        _status("UNAVAILABLE")  # type: ignore[arg-type]


class _NoSteps(StepExecutor):
    def submit(self, scheduler_output, expected):
        raise AssertionError("this engine must not step")


def _engine(emitted: list) -> EngineCore:
    return EngineCore(SchedulerConfig(), CacheConfig(block_size=16), _NoSteps(),
                      emit=lambda outputs, record: emitted.extend(outputs))


def _request(req_id: str, max_tokens: int) -> Request:
    return Request(request_id=req_id, prompt_token_ids=[1, 2, 3],
                   sampling_params=SamplingParams(max_tokens=max_tokens))


def test_engine_reports_unavailable_without_a_group_and_invalid_for_a_refusal():
    emitted: list = []
    engine = _engine(emitted)
    engine._add(_request("no-group", 4))  # no scheduler: the group is not ready
    engine.scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), 1)
    engine._add(_request("too-big", 64))  # needs 5 blocks, the pool has 1
    assert [(o.request_id, o.finish_reason, o.error_code) for o in emitted] == [
        ("no-group", FinishReason.ERROR, EngineErrorCode.UNAVAILABLE),
        ("too-big", FinishReason.ERROR, EngineErrorCode.INVALID_ARGUMENT),
    ]
    assert "could never be scheduled" in emitted[1].error
