"""--kv-transfer-config (core/kv_transfer_config.py) and the transfer
parameters of each leg (api/kv_transfer/params.py): what is accepted, and
every hostile value refused naming its key, with a fuzz of both."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.api.kv_transfer.params import DecodeLeg, parse_kv_transfer_params
from controlplane.api.validation import InvalidRequest
from controlplane.core.kv_connector import kv_connector_for
from controlplane.core.kv_transfer_config import parse_kv_transfer_config
from controlplane.core.request import DO_REMOTE_DECODE


def test_a_producer_and_a_consumer_config_and_their_connectors():
    assert parse_kv_transfer_config("") is None and parse_kv_transfer_config("  ") is None
    p = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}')
    assert p.produces and not p.consumes and p.kv_load_failure_policy == "recompute"
    assert p.lease_s == 30.0 and len(p.engine_id) == 32  # drawn once, at start-up
    c = parse_kv_transfer_config(json.dumps({
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "dec-0",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"kv_lease_duration": 5, "handshake_timeout": 0.5,
                                      "side_channel_host": "prefill-0.kvloom"}}))
    assert (c.consumes, c.produces, c.engine_id, c.lease_s, c.handshake_timeout_s) == (
        True, False, "dec-0", 5.0, 0.5)
    assert c.side_channel_host == "prefill-0.kvloom"
    both = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert both.produces and both.consumes
    spec = kv_connector_for(0, "kv_consumer")
    assert (spec.name, spec.role, spec.loads, spec.load_async, spec.produces) == (
        "NixlConnector", "kv_consumer", True, True, False)
    assert kv_connector_for(0, "kv_producer").produces
    assert kv_connector_for(1.0).name == "OffloadingConnector" and kv_connector_for(0) is None


@pytest.mark.parametrize("raw,names", [
    ("[1]", "JSON object"),
    ("{not json", "not JSON"),
    ("[" * 4000, "nested too deeply"),
    ('{"kv_role": "kv_producer"}', "kv_connector is required"),
    ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"}', "kv_connector"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_master"}', "kv_role"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_rank": 0}', "kv_rank"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "a b"}',
     "engine_id"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": ""}', "engine_id"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": 7}', "engine_id"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_load_failure_policy": "ignore"}', "kv_load_failure_policy"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": []}', "kv_connector_extra_config"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"kv_lease_duration": 0}}', "kv_lease_duration"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"kv_lease_duration": 1e9}}', "kv_lease_duration"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"kv_lease_duration": true}}', "kv_lease_duration"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"kv_lease_duration": NaN}}', "kv_lease_duration"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"handshake_timeout": -1}}', "handshake_timeout"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"port": 1}}', "port"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"side_channel_host": "a b/c"}}', "side_channel_host"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
     '"kv_connector_extra_config": {"side_channel_host": 5}}', "side_channel_host"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "x": "' + "y" * 5000 + '"}',
     "bytes"),
])
def test_hostile_configs_are_refused_naming_the_key(raw, names):
    with pytest.raises(ValueError, match=names):
        parse_kv_transfer_config(raw)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from([
                        "kv_connector", "kv_role", "engine_id", "kv_load_failure_policy",
                        "kv_connector_extra_config", "kv_lease_duration", "handshake_timeout",
                        "other"]), inner, max_size=5), max_leaves=12))
def test_any_json_is_a_config_or_a_value_error(value):
    try:
        config = parse_kv_transfer_config(json.dumps(value))
    except ValueError:
        return
    assert config is None or (config.kv_connector == "NixlConnector"
                               and math.isfinite(config.lease_s))


# ---- the legs' parameters ----------------------------------------------------

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prod-1",
        "remote_request_id": "kvlease-abc", "remote_block_ids": [[4, 5, 6]],
        "remote_host": "10.0.0.7", "remote_port": 5000, "tp_size": 1, "remote_num_tokens": 10,
        "remote_blocks_expiry_time": None}


def _parse(params, produces=True, consumes=True, prompt=10, max_blocks=8):
    raw = params if isinstance(params, str) else json.dumps(params)
    return parse_kv_transfer_params(raw, produces=produces, consumes=consumes,
                                    num_prompt_tokens=prompt, max_blocks=max_blocks)


def test_each_leg_parses_and_a_leg_asking_nothing_is_none():
    assert _parse({"do_remote_decode": True}) == DO_REMOTE_DECODE
    assert _parse({"do_remote_decode": True, "do_remote_prefill": False,
                   "remote_engine_id": None}) == DO_REMOTE_DECODE  # the toy proxy's shape
    assert _parse({}) is None and _parse({"do_remote_prefill": False}) is None
    leg = _parse(GOOD)
    assert leg == DecodeLeg("prod-1", "kvlease-abc", (4, 5, 6), "10.0.0.7", 5000, 1, 10)
    assert leg.address == "10.0.0.7:5000"
    assert _parse({**GOOD, "remote_host": "::1"}).address == "[::1]:5000"


@pytest.mark.parametrize("change,names", [
    ("[]", "JSON object"),
    ('"x"', "JSON object"),
    ("{", "not JSON"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both true"),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"remote_engine_id": "a b"}, "remote_engine_id"),
    ({"remote_engine_id": None}, "remote_engine_id"),
    ({"remote_request_id": "x" * 129}, "remote_request_id"),
    ({"remote_request_id": "a\nb"}, "remote_request_id"),
    ({"remote_block_ids": [4, 5]}, "remote_block_ids"),
    ({"remote_block_ids": [[4], [5]]}, "remote_block_ids"),
    ({"remote_block_ids": [[4, -1]]}, "remote_block_ids"),
    ({"remote_block_ids": [[4, 1 << 31]]}, "remote_block_ids"),
    ({"remote_block_ids": [[4, True]]}, "remote_block_ids"),
    ({"remote_block_ids": [[4, 4]]}, "twice"),
    ({"remote_block_ids": [list(range(9))]}, "at most 8"),
    ({"remote_host": "evil host/"}, "remote_host"),
    ({"remote_port": 0}, "remote_port"),
    ({"remote_port": 70000}, "remote_port"),
    ({"remote_port": "5000"}, "remote_port"),
    ({"tp_size": 0}, "tp_size"),
    ({"remote_num_tokens": 11}, "remote_num_tokens"),
    ({"remote_num_tokens": -1}, "remote_num_tokens"),
])
def test_hostile_parameters_are_refused_naming_the_field(change, names):
    params = change if isinstance(change, str) else {**GOOD, **change}
    with pytest.raises(InvalidRequest, match=names):
        _parse(params)


def test_a_leg_this_engine_has_no_role_for_is_refused():
    with pytest.raises(InvalidRequest, match="not a KV producer"):
        _parse({"do_remote_decode": True}, produces=False)
    with pytest.raises(InvalidRequest, match="not a KV consumer"):
        _parse(GOOD, consumes=False)
    with pytest.raises(InvalidRequest, match="bytes"):
        _parse(json.dumps({**GOOD, "pad": "x" * (1 << 20)}))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(GOOD)), st.none() | st.booleans() | st.integers()
                       | st.text(max_size=12) | st.lists(st.lists(st.integers(), max_size=4),
                                                          max_size=3), max_size=9))
def test_any_parameters_are_a_leg_or_an_invalid_request(changes):
    try:
        leg = _parse({**GOOD, **changes})
    except InvalidRequest:
        return
    assert leg is None or leg == DO_REMOTE_DECODE or (
        isinstance(leg, DecodeLeg) and leg.num_tokens <= 10 and len(leg.block_ids) <= 8)
