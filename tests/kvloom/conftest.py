"""Fakes for the client, CLI and launcher tests: an in-process grpc.aio
Generation server, fake `controlplane` / `workerd` packages that
`python -m` finds first when the tests chdir into their directory, and a
fake `smg` program (the SMG gateway) that PATH finds first."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc as pb_grpc


class FakeGeneration(pb_grpc.GenerationServicer):
    """Canned streams: "fail" errors, "slow" streams until aborted/cancelled,
    "broken" finishes with ERROR, anything else streams "a", "b", "c" per
    sample (n samples interleaved) and finishes with STOP. Logprobs and
    prompt logprobs come back when asked for, with made-up values."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.tokenize_requests: list[pb.TokenizeRequest] = []
        self.detokenize_requests: list[pb.DetokenizeRequest] = []
        self.aborted: set[str] = set()
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id or "srv-1"
        if request.text == "fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if request.text == "slow":
            async for msg in self._slow(rid):
                yield msg
            return
        sp = request.sampling
        n = sp.n if sp.HasField("n") else 1
        for i, piece in enumerate("abc"):
            for index in range(n):
                msg = pb.GenerateResponse(request_id=rid, index=index, token_ids=[i + 1],
                                          text=piece)
                if i == 0:
                    msg.prompt_info.CopyFrom(self._prompt_info(sp))
                if sp.HasField("logprobs"):
                    msg.logprobs.append(_logprob(i + 1, piece, i + 1, sp.logprobs))
                if i == 2:
                    msg.finish.CopyFrom(self._finish(request))
                yield msg

    @staticmethod
    def _prompt_info(sp) -> pb.PromptInfo:
        info = pb.PromptInfo(prompt_tokens=4, cached_tokens=2)
        if sp.HasField("prompt_logprobs"):
            info.prompt_logprobs.extend(
                _logprob(10 + k, f"p{k}", 1, sp.prompt_logprobs) for k in range(3)
            )
        return info

    @staticmethod
    def _finish(request) -> pb.FinishInfo:
        if request.text == "broken":
            return pb.FinishInfo(reason=pb.ERROR, prompt_tokens=4, output_tokens=3,
                                 error="rank 1 died")
        finish = pb.FinishInfo(reason=pb.STOP, prompt_tokens=4, output_tokens=3,
                               cached_tokens=2)
        if request.sampling.stop:
            finish.stop_str = request.sampling.stop[0]
        else:
            finish.stop_token_id = 3
        return finish

    async def _slow(self, rid):
        try:
            for i in range(1000):
                if rid in self.aborted:
                    yield pb.GenerateResponse(
                        request_id=rid, finish=pb.FinishInfo(reason=pb.ABORT, output_tokens=i)
                    )
                    return
                yield pb.GenerateResponse(request_id=rid, token_ids=[7], text="x")
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Abort(self, request, context):
        self.aborted.update(request.request_ids)
        return pb.AbortResponse(num_aborted=len(request.request_ids))

    async def Tokenize(self, request, context):
        self.tokenize_requests.append(request)
        if request.WhichOneof("input") == "messages":
            text = "".join(f"<{m.role}>{m.content}" for m in request.messages.messages)
        else:
            text = request.text
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text], text=text)

    async def Detokenize(self, request, context):
        self.detokenize_requests.append(request)
        return pb.DetokenizeResponse(text="".join(chr(t) for t in request.token_ids))

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(
            model_name="tiny", architecture="LlamaForCausalLM", vocab_size=511,
            max_model_len=256, eos_token_ids=[1], bos_token_id=0, has_chat_template=True,
            special_tokens=[pb.SpecialToken(content="<s>", id=0),
                            pb.SpecialToken(content="</s>", id=1)],
        )

    async def GetServerInfo(self, request, context):
        return pb.ServerInfo(version="0.1.0", tensor_parallel_size=1,
                             pipeline_parallel_size=2, num_ranks_attached=2,
                             num_requests_running=3, num_requests_waiting=1,
                             max_waiting_requests=64,
                             ranks=[pb.RankInfo(rank=0, host="10.0.0.1", device="cpu", pid=11,
                                                node_id="ray-node-a"),
                                    pb.RankInfo(rank=1, host="10.0.0.2", device="cuda:0",
                                                pid=12)])


def _logprob(token_id: int, token: str, rank: int, top: int) -> pb.Logprob:
    return pb.Logprob(
        token_id=token_id, logprob=-0.5 * rank, rank=rank, token=token,
        top=[pb.TopLogprob(token_id=100 + k, logprob=-0.25 * (k + 1), token=f"t{k}")
             for k in range(top)],
    )


class FakeHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        if request.service not in ("", "kvloom.v1.Generation"):
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def fake_server():
    """Run the fake on its own event loop thread so sync and async clients can use it."""
    servicer = FakeGeneration()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def serve():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(), server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["done"] = asyncio.Event()
        started.set()
        await holder["done"].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"127.0.0.1:{holder['port']}", servicer
    loop.call_soon_threadsafe(holder["done"].set)
    thread.join(10)
    assert not thread.is_alive()
    loop.close()


FAKE_CONTROLPLANE = '''
import http.server, os, sys, threading, time, grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvloom.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

class Generation(pb_grpc.GenerationServicer):
    def Generate(self, request, context):
        print("generate prompt", request.WhichOneof("prompt"), flush=True)
        for i, piece in enumerate("abc"):
            msg = pb.GenerateResponse(request_id="r", token_ids=[i], text=piece)
            if i == 2:
                msg.finish.reason = pb.STOP
            yield msg

    def GetServerInfo(self, request, context):
        pp = int(args[args.index("--pipeline-parallel-size") + 1])
        return pb.ServerInfo(pipeline_parallel_size=pp)

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name="fake-served")

    def ListLoRAAdapters(self, request, context):
        return pb.ListLoRAAdaptersResponse()

class Metrics(http.server.BaseHTTPRequestHandler):
    # Like the real one, /metrics answers on --metrics-port (tools scrape it).
    def do_GET(self):
        body = b"kvloom_step_broadcast_bytes_sum 400\\nkvloom_step_broadcast_bytes_count 4\\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

args = sys.argv[1:]
if "--check" in args:  # the launcher's preflight: nothing to check here
    sys.exit(0)
print("controlplane args", " ".join(args), flush=True)
print("controlplane token", os.environ.get("KVLOOM_AUTH_TOKEN"), flush=True)
metrics = http.server.HTTPServer(("127.0.0.1", int(args[args.index("--metrics-port") + 1])),
                                 Metrics)
threading.Thread(target=metrics.serve_forever, daemon=True).start()
server = grpc.server(futures.ThreadPoolExecutor(4))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
pb_grpc.add_GenerationServicer_to_server(Generation(), server)
server.add_insecure_port("127.0.0.1:" + args[args.index("--port") + 1])
server.start()
time.sleep(0.3)  # readiness comes later than liveness, as in the real one
servicer.set("kvloom.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
server.wait_for_termination()
'''

FAKE_WORKERD = '''
import os, sys, time
rank = sys.argv[sys.argv.index("--rank") + 1]
print("worker rank", rank, "up", flush=True)
print("worker args", " ".join(sys.argv[1:]), flush=True)
print("worker token", os.environ.get("KVLOOM_AUTH_TOKEN"), flush=True)
if rank == {failing_rank!r}:
    print("boom: cannot load shard", flush=True)
    sys.exit(3)
time.sleep(600)
'''


@pytest.fixture
def fake_daemons(tmp_path, monkeypatch):
    def install(failing_rank: str = "none") -> Path:
        for name, source in (("controlplane", FAKE_CONTROLPLANE),
                             ("workerd", FAKE_WORKERD.format(failing_rank=failing_rank))):
            pkg = tmp_path / "fakes" / name
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").write_text("")
            (pkg / "__main__.py").write_text(textwrap.dedent(source))
        # `python -m` searches the working directory first, ahead of the real packages.
        monkeypatch.chdir(tmp_path / "fakes")
        # Tests set their own token; one from the developer's shell must not leak in.
        monkeypatch.delenv("KVLOOM_AUTH_TOKEN", raising=False)
        return tmp_path

    return install


API_KEY = "client-test-key-0001"


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """Certificates for the TLS tests (tests/controlplane/api/pki.py)."""
    from tests.controlplane.api.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure_server(pki):
    """The fake Generation server secured as the controlplane secures it:
    start(tls=..., mtls=..., api_key=...) -> (address, servicer); TLS with
    pki.server, mTLS trusting pki.ca, the controlplane's API-key interceptor."""
    from controlplane.api.auth import ApiKeyInterceptor, ApiKeys

    loop = asyncio.new_event_loop()
    threads, holder = [], {}

    def start(tls: bool = True, mtls: bool = False, api_key: str | None = None):
        servicer = FakeGeneration()
        started = threading.Event()

        async def serve():
            interceptors = [ApiKeyInterceptor(ApiKeys(env_key=api_key))] if api_key else []
            server = grpc.aio.server(interceptors=interceptors)
            pb_grpc.add_GenerationServicer_to_server(servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(), server)
            if tls:
                creds = grpc.ssl_server_credentials(
                    [(pki.server.keyfile.read_bytes(), pki.server.certfile.read_bytes())],
                    root_certificates=pki.ca.read_bytes() if mtls else None,
                    require_client_auth=mtls)
                holder["port"] = server.add_secure_port("127.0.0.1:0", creds)
            else:
                holder["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            holder["done"] = asyncio.Event()
            started.set()
            await holder["done"].wait()
            await server.stop(0)

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        threads.append(thread)
        assert started.wait(10)
        return f"127.0.0.1:{holder['port']}", servicer

    yield start
    if threads:
        loop.call_soon_threadsafe(holder["done"].set)
        threads[0].join(10)
        assert not threads[0].is_alive()
    loop.close()


FAKE_SMG = r'''
import json, os, signal, socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# `smg launch ...` as kvloom_cli.gateway runs it: serves the OpenAI routes the
# CLI uses. FAKE_SMG_MODE: "fail" exits at once, "nomodel" lists no model
# (a worker that never registers), "notokenizer" lists the model but never
# its tokenizer, "chaterror" answers chats with a 400, "nodecode" (PD mode)
# never registers its decode workers. GET /workers lists each worker URL of
# its command line with its type ("regular", or "prefill" and "decode").
args = sys.argv[1:]
mode = os.environ.get("FAKE_SMG_MODE", "")
record = os.environ.get("FAKE_SMG_RECORD")
print("gateway args", " ".join(args), flush=True)
print("gateway env HF_HUB_OFFLINE=%s token=%s" % (os.environ.get("HF_HUB_OFFLINE"),
      os.environ.get("KVLOOM_AUTH_TOKEN")), flush=True)
if mode == "fail":
    print("boom: bad worker url", flush=True)
    sys.exit(2)
if "--pd-disaggregation" in args:
    workers = [(args[i + 1], flag[2:]) for i, flag in enumerate(args)
               if flag in ("--prefill", "--decode")]
else:
    workers = [(args[args.index("--worker-urls") + 1], "regular")]
if mode == "nodecode":
    workers = [(url, kind) for url, kind in workers if kind != "decode"]


def send(handler, code, doc):
    body = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/workers":
            return send(self, 200, {"workers": [{"url": u, "worker_type": k, "is_healthy": True}
                                                for u, k in workers]})
        if self.path == "/v1/tokenizers":
            names = [] if mode == "notokenizer" else ["fake-served"]
            return send(self, 200, {"tokenizers": [{"name": n, "id": "t1"} for n in names]})
        if self.path != "/v1/models" or mode == "nomodel":
            return send(self, 503, {"error": {"message": "No models available"}})
        send(self, 200, {"object": "list", "data": [{"id": "fake-served"}]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if record:
            with open(record, "ab") as f:
                f.write(body + b"\n")
        if mode == "chaterror":
            return send(self, 400, {"error": {"message": "temperature out of range"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]}
                  for c in "abc"]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b": done\ndata: [DONE]\n\n")

    def log_message(self, *args):
        pass


def listening(url):
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def stop(signum, frame):
    # Whether every controlplane still listened when we were told to stop.
    up = all(listening(url) for url, _ in workers)
    print("gateway stopping; controlplane up:", up, flush=True)
    os._exit(0)


signal.signal(signal.SIGTERM, stop)
server = ThreadingHTTPServer((args[args.index("--host") + 1],
                              int(args[args.index("--port") + 1])), Handler)
print("gateway up", flush=True)
server.serve_forever()
'''


@pytest.fixture
def fake_smg(tmp_path, monkeypatch):
    """install(mode="") puts a fake `smg` first on PATH; returns the file
    where it appends each chat request's body (one JSON a line)."""

    def install(mode: str = "") -> Path:
        bin_dir = tmp_path / "fake-bin"
        bin_dir.mkdir(exist_ok=True)
        smg = bin_dir / "smg"
        smg.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SMG))
        smg.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.setenv("FAKE_SMG_MODE", mode)
        record = tmp_path / "smg-requests.jsonl"
        monkeypatch.setenv("FAKE_SMG_RECORD", str(record))
        return record

    return install
