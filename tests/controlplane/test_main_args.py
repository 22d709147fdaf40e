"""controlplane flags come from the config dataclasses: same defaults, the
flag spellings deployments use, hostile values refused naming the flag."""

from __future__ import annotations

import dataclasses
import os

import pytest

from controlplane.__main__ import CONFIG_GROUPS, build_config, build_parser
from kvloom.common.config_args import flag_of, option_fields
from tests.checkpoints import config_only_checkpoint

# Fields that are no flag: build_config resolves them at start-up.
RESOLVED = {("SchedulerConfig", "max_model_len"), ("CacheConfig", "sliding_window"),
            ("ModelConfig", "checkpoint_dtype"), ("SchedulerConfig", "speculative"),
            ("SchedulerConfig", "max_loras"), ("LoRAConfig", "lora_modules")}

# Every spelling the launcher, compose file, Helm chart and tests pass today.
DEPLOYED_FLAGS = [
    "--model=/m", "--served-model-name=m", "--worker-model-path=/w", "--dtype=bfloat16",
    "--max-model-len=64", "--seed=3", "--tensor-parallel-size=2", "-tp=2",
    "--pipeline-parallel-size=2", "-pp=2", "--pp-layer-partition=1,1", "--pp-layer-partition=",
    "--block-size=32", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--num-gpu-blocks-override=0", "--kv-cache-memory-bytes=1024",
    "--gpu-memory-utilization=0.5", "--max-num-seqs=8", "--max-num-batched-tokens=64",
    "--long-prefill-token-threshold=0", "--scheduling-policy=priority", "--host=0.0.0.0",
    "--port=1", "--worker-port=2", "--metrics-port=0", "--auth-token=t",
    "--max-waiting-requests=0", "--drain-timeout=0", "--shutdown-timeout=20",
    "--max-message-bytes=1024",
    "--step-timeout=5", "--heartbeat-timeout=3", "--startup-timeout=9", "--log-level=DEBUG",
    "--engine-recovery-timeout=0", "--engine-recovery-timeout=120",
    # Issue 11, the worker plane (start-up checks: tests/controlplane/executor/
    # test_worker_trust.py).
    "--auth-token-file=/run/secrets/kvloom-auth-token", "--auth-token-file=",
    "--worker-ssl-certfile=/etc/kvloom/tls/worker-port.crt",
    "--worker-ssl-keyfile=/etc/kvloom/tls/worker-port.key",
    "--worker-ssl-ca-certs=/etc/kvloom/tls/ca.crt",
    # Issue 11, the client API (start-up checks below and in
    # tests/controlplane/api/test_api_security.py).
    "--ssl-certfile=/etc/kvloom/tls/api.crt", "--ssl-keyfile=/etc/kvloom/tls/api.key",
    "--ssl-ca-certs=/etc/kvloom/tls/clients-ca.crt", "--ssl-certfile=",
    "--api-key-file=/run/secrets/kvloom-api-keys", "--api-key-file=",
    "--prefix-cache-scope=key", "--prefix-cache-scope=global",
    "--max-requests-per-key=0", "--max-requests-per-key=64",
    # Issue 14: the workers' attention kernels.
    "--attention-backend=auto", "--attention-backend=torch", "--attention-backend=flashinfer",
    "--enforce-eager", "--no-enforce-eager",
    # Issue 31: the gateway's engine protocol.
    "--vllm-engine-auth=api-key", "--vllm-engine-auth=client-certificate",
    "--enable-kv-cache-events", "--no-enable-kv-cache-events",
]


@pytest.fixture(autouse=True)
def _no_kvloom_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVLOOM_"):
            monkeypatch.delenv(name)


def _all_fields():
    for _, cls in CONFIG_GROUPS:
        for field in dataclasses.fields(cls):
            yield cls, field


def test_every_field_is_a_flag_defaulting_to_the_dataclass_default():
    args = build_parser().parse_args([])
    for cls, field in _all_fields():
        if (cls.__name__, field.name) in RESOLVED:
            assert field not in option_fields(cls)
            continue
        assert field in option_fields(cls), f"{cls.__name__}.{field.name} has no flag"
        assert getattr(args, field.name) == field.default, flag_of(field)


def test_help_shows_defaults():
    text = " ".join(build_parser().format_help().split())
    assert "--block-size BLOCK_SIZE tokens per KV block [env KVLOOM_BLOCK_SIZE] (default: 16)" \
        in text
    assert "--step-timeout STEP_TIMEOUT" in text and "(default: 60.0)" in text


@pytest.mark.parametrize("flag", DEPLOYED_FLAGS)
def test_deployed_flag_spellings_parse(flag):
    build_parser().parse_args([flag])


def test_flags_land_in_their_fields():
    args = build_parser().parse_args(
        ["-tp", "2", "--pp-layer-partition", "16,14", "--scheduling-policy", "priority",
         "--step-timeout", "5", "--no-enable-prefix-caching"]
    )
    assert (args.tensor_parallel_size, args.pp_layer_partition, args.policy) == (
        2, (16, 14), "priority")
    assert args.step_timeout_s == 5.0 and args.enable_prefix_caching is False


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--block-size", "0"], "--block-size"),
        (["--max-num-seqs", "-1"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--stream-interval", "0"], "--stream-interval"),
        (["--stream-interval", "1025"], "--stream-interval"),
        (["-tp", "0"], "--tensor-parallel-size"),
        (["--pipeline-parallel-size", "-2"], "--pipeline-parallel-size"),
        (["--pp-layer-partition", "4,0"], "--pp-layer-partition"),
        (["--step-timeout", "0"], "--step-timeout"),
        (["--heartbeat-timeout", "-1"], "--heartbeat-timeout"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--port", "-1"], "--port"),
        (["--num-gpu-blocks-override", "-4"], "--num-gpu-blocks-override"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy"),
        (["--kv-offloading-size", "-1"], "--kv-offloading-size"),
        (["--kv-offloading-size", "nan"], "--kv-offloading-size"),
        (["--kv-offloading-size", "4097"], "--kv-offloading-size"),
        (["--kv-offloading-backend", "lmcache"], "--kv-offloading-backend"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--shutdown-timeout", "3601"], "--shutdown-timeout"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
        (["--drain-timeout", "inf"], "--shutdown-timeout"),
        (["--step-timeout", "nan"], "--step-timeout"),
        (["--engine-recovery-timeout", "-1"], "--engine-recovery-timeout"),
        (["--engine-recovery-timeout", "nan"], "--engine-recovery-timeout"),
        (["--engine-recovery-timeout", "inf"], "--engine-recovery-timeout"),
        (["--engine-recovery-timeout", "1e9"], "--engine-recovery-timeout"),
        (["--prefix-cache-scope", "tenant"], "--prefix-cache-scope"),
        (["--prefix-cache-scope", ""], "--prefix-cache-scope"),
        (["--max-requests-per-key", "-1"], "--max-requests-per-key"),
        (["--max-requests-per-key", "1.5"], "--max-requests-per-key"),
        (["--max-requests-per-key", "nan"], "--max-requests-per-key"),
        (["--attention-backend", "FLASH_ATTN"], "--attention-backend"),
        (["--attention-backend", ""], "--attention-backend"),
        (["--vllm-engine-auth", "none"], "--vllm-engine-auth"),
        (["--vllm-engine-auth", ""], "--vllm-engine-auth"),
        (["--enable-kv-cache-events=yes"], "--enable-kv-cache-events"),
        (["--max-loras", "0"], "--max-loras"),
        (["--max-loras", "65"], "--max-loras"),
        (["--max-lora-rank", "0"], "--max-lora-rank"),
        (["--max-lora-rank", "513"], "--max-lora-rank"),
        (["--max-cpu-loras", "-1"], "--max-cpu-loras"),
        (["--max-cpu-loras", "1025"], "--max-cpu-loras"),
    ],
)
def test_hostile_values_are_refused_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert f"argument {named}" in err, err


def test_hostile_env_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KVLOOM_BLOCK_SIZE", "0")
    with pytest.raises(SystemExit, match="KVLOOM_BLOCK_SIZE='0': must be >= 1"):
        build_parser().parse_args([])


def test_enforce_eager_flag_and_variable(monkeypatch, capsys):
    assert build_parser().parse_args([]).enforce_eager is False
    assert build_parser().parse_args(["--enforce-eager"]).enforce_eager is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--enforce-eager=1"])  # a switch, not a value
    assert "--enforce-eager" in capsys.readouterr().err
    monkeypatch.setenv("KVLOOM_ENFORCE_EAGER", "true")
    assert build_parser().parse_args([]).enforce_eager is True
    monkeypatch.setenv("KVLOOM_ENFORCE_EAGER", "2")
    with pytest.raises(SystemExit, match="KVLOOM_ENFORCE_EAGER='2': expected true/false"):
        build_parser().parse_args([])


@pytest.fixture
def model_dir(tmp_path):
    return config_only_checkpoint(tmp_path, with_tokenizer=False)


def _build(argv):
    parser = build_parser()
    return build_config(parser.parse_args(argv), parser)


def test_build_config_resolves_start_up_values(model_dir):
    config, info = _build(["--model", model_dir])
    assert config.scheduler.max_model_len == info.max_position_embeddings == 128
    assert config.model.served_model_name == "tiny"
    assert config.model.worker_model_path == model_dir
    assert config.cache == type(config.cache)()
    assert _build(["--model", model_dir, "--max-model-len", "64"])[0].scheduler.max_model_len == 64


@pytest.mark.parametrize("value", ["129", "-1"])
def test_max_model_len_outside_the_model_is_refused(model_dir, value, capsys):
    with pytest.raises(SystemExit):
        _build(["--model", model_dir, "--max-model-len", value])
    assert f"--max-model-len {value} must be in 1..128" in capsys.readouterr().err


def test_drain_timeout_is_a_deprecated_alias_of_shutdown_timeout():
    args = build_parser().parse_args(["--drain-timeout", "7"])
    assert args.shutdown_timeout_s == 7.0
    # The default fits Kubernetes' default 30 s termination grace period.
    assert build_parser().parse_args([]).shutdown_timeout_s < 30


# ---- client API security: start-up checks (one line naming the flag, exit 2) ----


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from tests.controlplane.api.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


def _main_check(model_dir, argv, capsys) -> tuple[int, str, str]:
    from controlplane.__main__ import main

    try:
        main(["--model", model_dir, "--port=0", "--worker-port=0", "--check", *argv])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def served_model_dir(tmp_path):
    return config_only_checkpoint(tmp_path)


def test_secured_api_flags_pass_the_check(served_model_dir, pki, tmp_path, capsys,
                                          monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-one\n")
    monkeypatch.setenv("KVLOOM_API_KEY", "key-two")
    code, out, err = _main_check(served_model_dir, [
        "--ssl-certfile", str(pki.server.certfile), "--ssl-keyfile", str(pki.server.keyfile),
        "--ssl-ca-certs", str(pki.ca), "--api-key-file", str(keys)], capsys)
    assert code == 0, err
    assert "the ports are usable" in out


@pytest.mark.parametrize(("argv", "problem"), [
    (["--ssl-certfile", "{cert}"], "--ssl-certfile {cert} needs --ssl-keyfile"),
    (["--ssl-keyfile", "{key}"], "--ssl-keyfile {key} needs --ssl-certfile"),
    (["--ssl-ca-certs", "{ca}"], "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile"),
    (["--ssl-certfile", "{absent}", "--ssl-keyfile", "{key}"],
     "--ssl-certfile {absent}: cannot read it: No such file or directory"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{other_key}"],
     "not a PEM certificate and its matching private key"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{absent}"],
     "--ssl-ca-certs {absent}: cannot read it"),
    (["--api-key-file", "{absent}"], "--api-key-file {absent}: cannot read it"),
    (["--api-key-file", "{empty}"], "--api-key-file {empty}: holds no key"),
    (["--api-key-file", "{spaced}"], "--api-key-file {spaced} line 2: an API key must be"),
])
def test_unusable_api_security_flags_end_start_up(served_model_dir, pki, tmp_path, capsys,
                                                  argv, problem):
    (tmp_path / "empty").write_text("\n# nothing\n")
    (tmp_path / "spaced").write_text("fine\nnot fine\n")
    paths = {"cert": pki.server.certfile, "key": pki.server.keyfile, "ca": pki.ca,
             "other_key": pki.client.keyfile, "absent": tmp_path / "absent.pem",
             "empty": tmp_path / "empty", "spaced": tmp_path / "spaced"}
    argv = [a.format(**paths) for a in argv]
    code, _, err = _main_check(served_model_dir, argv, capsys)
    assert code == 2
    assert err.startswith("kvloom-controlplane: error: ") and err.count("\n") == 1, err
    assert problem.format(**paths) in err
    assert "not fine" not in err


def test_a_malformed_kvloom_api_key_ends_start_up_unechoed(served_model_dir, capsys,
                                                          monkeypatch):
    monkeypatch.setenv("KVLOOM_API_KEY", "two words")
    code, _, err = _main_check(served_model_dir, [], capsys)
    assert code == 2 and "KVLOOM_API_KEY: an API key must be" in err
    assert "two words" not in err


def test_kv_transfer_config_is_parsed_at_start_up_and_refused_naming_the_key(model_dir, capsys):
    config, _ = _build(["--model", model_dir, "--kv-transfer-config",
                        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", '
                        '"engine_id": "p0"}'])
    assert (config.kv_transfer.engine_id, config.kv_transfer.produces) == ("p0", True)
    assert _build(["--model", model_dir])[0].kv_transfer is None
    both = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    for extra, named in [(["--kv-transfer-config", '{"kv_role": "kv_both"}'], "kv_connector"),
                         (["--kv-transfer-config", "[]"], "JSON object"),
                         (["--kv-transfer-config", both, "--kv-offloading-size", "1"],
                          "one KV connector at a time")]:
        with pytest.raises(SystemExit):
            _build(["--model", model_dir, *extra])
        assert named in capsys.readouterr().err


def test_lora_flags_are_resolved_and_refused_naming_the_flag(model_dir, capsys):
    config, _ = _build(["--model", model_dir, "--enable-lora", "--max-loras", "2",
                        "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"])
    assert config.lora.lora_modules == (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
    assert config.lora.cpu_slots == 2 and config.scheduler.max_loras == 2
    assert _build(["--model", model_dir])[0].scheduler.max_loras == 0
    both = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    for extra, named in [(["--lora-modules", "a=/x"], "needs --enable-lora"),
                         (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
                          "--max-cpu-loras 2 must be at least --max-loras 4"),
                         (["--enable-lora", "--lora-modules", "a=rel"], "absolute"),
                         (["--enable-lora", "--lora-modules", "tiny=/x"], "served model"),
                         (["--enable-lora", "--lora-engine-ports", "9-1"], "--lora-engine-ports"),
                         (["--enable-lora", "--kv-transfer-config", both], "--kv-transfer-config")]:
        with pytest.raises(SystemExit):
            _build(["--model", model_dir, *extra])
        assert named in capsys.readouterr().err
