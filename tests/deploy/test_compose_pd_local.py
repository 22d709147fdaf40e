"""deploy/compose.pd.yml with `--profile gateway`, run as local processes
(tests/deploy/test_compose_local.py's ComposeRun): the prefill cluster (KV
producer), the decode cluster (KV consumer) and the real SMG gateway started
by its PD entrypoint register as one prefill and one decode worker and
answer an OpenAI completion with transformers' greedy text. The metrics show
the transfer (tests/kvloom/pd_metrics.py): the prefill cluster ran the prompt
and a 1-token leg and held its KV, the decode cluster read it, over the
producer's side_channel_host (its service name, loopback here like every
compose host name), and released it.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.deploy.localrun import LOOPBACK, ROOT, LocalProcesses, assign_ports, base_env
from tests.deploy.test_compose_local import (
    GATEWAY_PORT_VARIABLES,
    PORT_VARIABLES,
    ComposeRun,
    _compose_config,
    _get_json,
    _local_value,
    _secrets_dir,
)
from tests.kvloom.pd_metrics import PDMetrics

pytestmark = pytest.mark.slow

PD_FILE = ROOT / "deploy" / "compose.pd.yml"
# The decode cluster's port variables, with the file's defaults.
DECODE_PORT_VARIABLES = {
    "KVLOOM_DECODE_PORT": 50051,
    "KVLOOM_DECODE_WORKER_PORT": 50052,
    "KVLOOM_DECODE_METRICS_PORT": 9090,
    "KVLOOM_DECODE_DIST_PORT": 29500,
    "KVLOOM_DECODE_WORKER0_METRICS_PORT": 9091,
    "KVLOOM_DECODE_WORKER1_METRICS_PORT": 9091,
}
SERVED = "tiny-compose-pd"
PROMPT = "hello world, the sea is"
MAX_TOKENS = 8


def test_every_decode_port_variable_is_read_by_the_file():
    text = PD_FILE.read_text()
    for var, default in DECODE_PORT_VARIABLES.items():
        assert f"${{{var}:-{default}}}" in text, f"{var} (default {default}) not in the file"


def test_the_producers_side_channel_host_runs_on_loopback_here():
    """Compose host names become loopback in the local run, inside the
    --kv-transfer-config JSON too; other strings stay as they are."""
    hosts = {"controlplane", "controlplane-decode"}
    flag = ('--kv-transfer-config={"kv_connector":"NixlConnector","kv_role":"kv_producer",'
            '"kv_connector_extra_config":{"side_channel_host":"controlplane"}}')
    local = json.loads(_local_value(flag, hosts).split("=", 1)[1])
    assert local == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                     "kv_connector_extra_config": {"side_channel_host": LOOPBACK}}
    assert _local_value("{not json", hosts) == "{not json"


def _matches_greedy(text: str, reference: str) -> bool:
    """The gateway's text is transformers' greedy text, but for a last token
    that ends inside a UTF-8 character: the gateway's streaming detokenizer
    holds those bytes back, a one-shot decode renders them U+FFFD."""
    return text == reference or (reference.startswith(text)
                                 and not reference[len(text):].strip("\ufffd"))


def test_compose_pd_gateway_serves_through_both_clusters(tiny_model_dir, tmp_path):
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    from tests.integration.reference import hf_greedy

    env = base_env(tmp_path)
    if shutil.which("smg", path=env["PATH"]) is None:
        pytest.skip('needs the SMG gateway: pip install "kvloom[gateway]"')
    ports = assign_ports({**PORT_VARIABLES, **DECODE_PORT_VARIABLES, **GATEWAY_PORT_VARIABLES})
    variables = {var: str(port) for var, port in ports.items()}
    variables.update(KVLOOM_MODEL=tiny_model_dir, KVLOOM_NUM_THREADS="1",
                     KVLOOM_SERVED_MODEL_NAME=SERVED,
                     KVLOOM_SECRETS_DIR=str(_secrets_dir(tmp_path)))
    profiles = ("gateway",)
    config = _compose_config({**env, **variables}, "deploy/compose.pd.yml", profiles=profiles)
    run = ComposeRun(config, env, profiles)
    assert set(run.services) == {"controlplane", "workerd-0", "workerd-1", "controlplane-decode",
                                 "workerd-decode-0", "workerd-decode-1", "gateway"}
    with LocalProcesses(tmp_path / "logs") as procs:
        run.start_all(procs)
        base = f"http://{LOOPBACK}:{ports['OPENAI_PORT']}"
        procs.wait_for("the tokenizer", lambda: SERVED in [
            t["name"] for t in _get_json(f"{base}/v1/tokenizers")["tokenizers"]], 60)
        workers = _get_json(f"{base}/workers")["workers"]
        assert sorted(w["worker_type"] for w in workers) == ["decode", "prefill"], workers
        assert all(w["is_healthy"] for w in workers), workers
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120,
                               max_retries=0)
        prefill = f"http://{LOOPBACK}:{ports['KVLOOM_METRICS_PORT']}/metrics"
        decode = f"http://{LOOPBACK}:{ports['KVLOOM_DECODE_METRICS_PORT']}/metrics"
        metrics = PDMetrics(prefill, decode)
        done = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].finish_reason == "length", done
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        ids = tok.encode(PROMPT)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), MAX_TOKENS)
        want = tok.decode(hf_greedy(tiny_model_dir, ids, MAX_TOKENS), skip_special_tokens=True)
        assert _matches_greedy(done.choices[0].text, want), (done.choices[0].text, want)
        metrics.check_one_request(len(ids), MAX_TOKENS)
        procs.check_alive()
