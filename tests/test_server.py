"""The Triton deployment on the real tritonserver, started as users start it (`dspark serve`):
ensemble (TensorRT-LLM's request format) -> preprocessing -> dspark (BLS scheduler calling the
`target` and `drafter` models) -> postprocessing, n-gram drafter with the DSpark scheduler
(Algorithm 1, `dspark-theory`: the ranked budget without the drafting-cost rule, so every step
drafts whatever the timing; the cost rule, the default, is served in tests/test_clients.py) on
the tiny checkpoint. Greedy output equals in-process plain decoding over gRPC, HTTP, streaming
and the direct BLS path; 16 concurrent streams; stop words free their slot; every client path of
cancellation frees the slot and is counted; bad input -> 400 / INVALID_ARG naming the field;
5 MB and 50 MB bodies are refused without harm; metrics; stop by pid leaves nothing behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from serve_helpers import Serve, process_group_members, wait_idle

from dspark.paths import REPO_ROOT
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sps import SPSTable
from dspark.runtime.target import TargetEngine
from dspark.runtime.text import decode, encode

pytestmark = pytest.mark.integration

PROMPT = "def greet(name):\n    return"
MAX_TOKENS = 16
LONG_TOKENS = 100  # long enough for the n-gram drafter to get drafts accepted on the tiny target
MAX_SEQ_LEN = 192
CAPACITY = 2
GAMMA = 7


sys.path.insert(0, str(REPO_ROOT / "clients"))
import generate_client as client  # noqa: E402


def server_env(ckpt: Path, sps: str = "gpu_shaped") -> dict[str, str]:
    return {
        "DSPARK_MODEL": str(ckpt),
        "DSPARK_CAPACITY": str(CAPACITY),
        "DSPARK_MAX_SEQ_LEN": str(MAX_SEQ_LEN),
        "DSPARK_NUM_THREADS": "1",
        "DSPARK_DEVICE": "cpu",
        "DSPARK_DRAFTER": "ngram",
        "DSPARK_POLICY": "dspark-theory",
        "DSPARK_GAMMA": str(GAMMA),
        "DSPARK_SPS": sps,
        "DSPARK_DTYPE": "fp32",
    }


def greedy_texts(ckpt: Path) -> dict[int, str]:
    """In-process greedy plain decoding of PROMPT as text after n tokens: what the server must return."""
    engine = TargetEngine.from_pretrained(ckpt, capacity=1, max_seq_len=MAX_SEQ_LEN)
    ids = SpecEngine(engine).generate([encode(engine.tokenizer, PROMPT)], LONG_TOKENS)[0]
    return {n: decode(engine.tokenizer, ids[:n]) for n in range(1, LONG_TOKENS + 1)}


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    """(running `dspark serve`, expected texts); the reference decode runs while the server loads.
    A flat, slow SPS table (100 ms per step at any batch) makes a verified draft token nearly free
    next to a step, so the budget admits every draft with a positive survival. (The default
    policy's cost rule would measure the tiny target's ms steps and, its drafts rejected, decode
    plain but for probes: whether a given request drafts would depend on the timing.)"""
    folder = tmp_path_factory.mktemp("serve")
    log, sps = folder / "serve.log", folder / "sps_flat.json"
    SPSTable([1, 64, 512], [10.0, 10.0, 10.0], device="test-flat", model="tiny").save(sps)
    srv = Serve(log=log, env=server_env(tiny_ckpt, str(sps))).start()
    try:
        expected = greedy_texts(tiny_ckpt)
        srv.wait_ready(timeout=300)
        yield srv, expected
    finally:
        srv.stop()


@pytest.fixture
def server(served) -> Serve:
    return served[0]


@pytest.fixture
def expected_text(served) -> str:
    return served[1][MAX_TOKENS]


# ---- output ----


def test_grpc_stream_matches_in_process_greedy(server, expected_text):
    stats = client.Stats()
    pieces = list(client.generate_grpc(server.grpc_url, PROMPT, MAX_TOKENS, stream=True, stats=stats))
    assert len(pieces) > 1 and "".join(pieces) == expected_text
    assert stats.output_tokens == MAX_TOKENS and stats.input_tokens > 0


def test_http_generate_and_stream_match_in_process_greedy(server, expected_text):
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS)) == [expected_text]
    assert "".join(client.generate_http(server.http_url, PROMPT, MAX_TOKENS, stream=True)) == expected_text


def test_direct_bls_model_matches(server, expected_text):
    """Clients may call the `dspark` BLS model directly with the same request (like
    TensorRT-LLM's tensorrt_llm_bls), over gRPC and HTTP."""
    assert "".join(client.generate_grpc(server.grpc_url, PROMPT, MAX_TOKENS, model="dspark")) == expected_text
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS, model="dspark")) == [expected_text]


def test_output_includes_the_prompt_unless_excluded(server, expected_text):
    """TensorRT-LLM's default: a non-streaming text_output starts with the input."""
    body = json.dumps({"text_input": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    import urllib.request

    with urllib.request.urlopen(
        urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", data=body), timeout=60
    ) as r:
        assert json.loads(r.read())["text_output"] == PROMPT + expected_text


def test_sixteen_concurrent_streams_each_get_their_own_text(served):
    server, expected = served
    lengths = [3 + (i * 5) % 40 for i in range(16)]  # 16 streams over 2 KV slots: continuous batching
    with ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(
                lambda n, i: "".join(
                    (client.generate_grpc if i % 2 else client.generate_http)(
                        server.grpc_url if i % 2 else server.http_url, PROMPT, n, stream=True
                    )
                ),
                n,
                i,
            )
            for i, n in enumerate(lengths)
        ]
        assert [f.result(timeout=300) for f in futures] == [expected[n] for n in lengths]


def test_stop_word_cuts_and_frees_its_slot(served):
    server, expected = served
    text = expected[MAX_TOKENS]
    stop = text[3:5]
    before = wait_idle(server.metrics_url)
    cut = list(client.generate_grpc(server.grpc_url, PROMPT, LONG_TOKENS, stream=False, stop=[stop]))
    assert cut == [text[: text.find(stop)]]
    after = wait_idle(server.metrics_url)  # ended in the engine, not decoded to LONG_TOKENS
    assert after["dspark_emitted_tokens_total"] - before["dspark_emitted_tokens_total"] <= MAX_TOKENS + GAMMA


# ---- speculation and metrics ----


def test_long_generation_speculates_and_metrics_count_it(served):
    """Drafts are proposed and verified through the BLS and counted consistently. Whether the
    n-gram drafts of this random model are *accepted* is up to the model (no n-gram repeats, no
    accepted draft), so acceptance itself is asserted where it is known:
    tests/test_triton_smollm2.py (trained drafter, fixed policy)."""
    server, expected = served
    before = wait_idle(server.metrics_url)
    stats = client.Stats()
    assert list(client.generate_http(server.http_url, PROMPT, LONG_TOKENS, stats=stats)) == [
        expected[LONG_TOKENS]
    ]
    after = wait_idle(server.metrics_url)
    counters = ("steps", "drafted_tokens", "verified_tokens", "accepted_tokens", "emitted_tokens")
    names = [f"dspark_{c}_total" for c in counters] + ["dspark_acceptance_length_count"]
    grew = {k: after[k] - before[k] for k in names}
    assert grew["dspark_drafted_tokens_total"] > 0 and grew["dspark_verified_tokens_total"] > 0, grew
    assert (grew["dspark_drafted_tokens_total"] >= grew["dspark_verified_tokens_total"]
            >= grew["dspark_accepted_tokens_total"] >= 0), grew  # output still == plain greedy
    assert grew["dspark_emitted_tokens_total"] == LONG_TOKENS
    assert grew["dspark_acceptance_length_count"] == grew["dspark_steps_total"]
    # every step emits one token beyond its accepted drafts, the prefill the first: accepted
    # drafts save target steps one for one, and the client's τ counts the same steps
    steps = grew["dspark_steps_total"]
    assert steps + grew["dspark_accepted_tokens_total"] == LONG_TOKENS - 1, grew
    assert stats.accepted_drafts == grew["dspark_accepted_tokens_total"]
    assert stats.tau == pytest.approx((LONG_TOKENS - 1) / steps)
    assert 0 <= after['dspark_position_acceptance{position="1"}'] <= 1
    assert f'dspark_position_acceptance{{position="{GAMMA}"}}' in after
    assert after["dspark_drafter_fallbacks_total"] == 0
    assert 0 <= after["dspark_verify_budget"] <= CAPACITY * GAMMA
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_latency_seconds"):
        assert after[f"dspark_{hist}_count"] > before.get(f"dspark_{hist}_count", 0), hist
    assert (
        after['dspark_finished_requests_total{reason="length"}']
        > before['dspark_finished_requests_total{reason="length"}']
    )
    assert after["dspark_queued_requests"] == 0


# ---- cancellation: every path a client can take frees the slot within a step or two ----


def _grpc_stream(server: Serve, model: str, stream: bool, max_tokens: int):
    responses: queue.Queue = queue.Queue()
    triton = grpcclient.InferenceServerClient(server.grpc_url)
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    fields = client.request_fields(PROMPT, max_tokens, stream)
    triton.async_stream_infer(model, client.grpc_inputs(fields))
    return triton, responses


def _assert_cancelled(server: Serve, before: dict, max_tokens: int) -> dict:
    after = wait_idle(server.metrics_url)
    assert after["dspark_cancelled_requests_total"] - before["dspark_cancelled_requests_total"] == 1
    # stopped early: the tiny model decodes ~150 tokens/s, the request had max_tokens to go
    assert after["dspark_emitted_tokens_total"] - before["dspark_emitted_tokens_total"] < max_tokens * 3 // 4
    return after


@pytest.mark.parametrize("model", ["ensemble", "dspark"])
@pytest.mark.parametrize("stream", [True, False])
def test_grpc_cancel_frees_the_slot(server, model, stream):
    max_tokens = MAX_SEQ_LEN - 40
    before = wait_idle(server.metrics_url)
    triton, responses = _grpc_stream(server, model, stream, max_tokens)
    if stream:
        for _ in range(2):
            result, error = responses.get(timeout=60)
            assert error is None
    else:
        time.sleep(0.2)  # running: a non-streaming request sends nothing until it ends
    triton.stop_stream(cancel_requests=True)
    triton.close()
    _assert_cancelled(server, before, max_tokens)


KILLED_CLIENT = """
import sys, time
sys.path.insert(0, {clients!r})
import generate_client as c
for i, piece in enumerate(c.generate_grpc({url!r}, {prompt!r}, {n}, stream=True, model={model!r})):
    if i == 2:
        print("reading", flush=True)
        time.sleep(600)
"""


@pytest.mark.parametrize("model", ["ensemble", "dspark"])
def test_killed_client_frees_the_slot(server, model):
    max_tokens = MAX_SEQ_LEN - 40
    before = wait_idle(server.metrics_url)
    code = KILLED_CLIENT.format(
        clients=str(REPO_ROOT / "clients"), url=server.grpc_url, prompt=PROMPT, n=max_tokens, model=model
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"reading"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _assert_cancelled(server, before, max_tokens)


@pytest.mark.parametrize("model", ["ensemble", "dspark"])
def test_closed_http_generate_stream_frees_the_slot(server, model):
    """curl's timeout or a closed browser tab: the socket closes mid-stream (through the front)."""
    max_tokens = MAX_SEQ_LEN - 40
    before = wait_idle(server.metrics_url)
    body = json.dumps({"text_input": PROMPT, "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    sock.sendall(
        f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while received.count(b"data:") < 2:
        received += sock.recv(4096)
    sock.close()
    _assert_cancelled(server, before, max_tokens)


# ---- edges ----


@pytest.mark.parametrize(
    "field, body",
    [
        ("top_p", {"top_p": 1.5}),
        ("temperature", {"temperature": -1.0}),
        ("temperature", {"temperature": 1e30}),
        ("temperature", {"temperature": 1e39}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": 10 * MAX_SEQ_LEN}),
        ("max_tokens", {"max_tokens": 1e10}),
        ("max_tokens", {"max_tokens": "8"}),
        ("max_tokens", {"max_tokens": 8.5}),
        ("seed", {"seed": -1}),
        ("stop_words", {"stop_words": 3}),
        ("text_input", {"text_input": ""}),
        ("beam_width", {"beam_width": 2}),
        ("return_log_probs", {"return_log_probs": True}),
        ("lora_task_id", {"lora_task_id": 1}),
        ("bogus", {"bogus": 1}),
        ("stream", {"stream": True}),
    ],
)
def test_bad_field_is_400_naming_it_and_server_stays_ready(server, expected_text, field, body):
    import urllib.error
    import urllib.request

    payload = {"text_input": PROMPT, "max_tokens": MAX_TOKENS} | body
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/ensemble/generate", data=json.dumps(payload).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 400 and field in e.value.read().decode()
    assert server.is_ready()


@pytest.mark.parametrize(
    "field, kwargs",
    [("top_p", dict(top_p=1.5)), ("max_tokens", dict(max_tokens=0)), ("text_input", dict(prompt=""))],
)
def test_grpc_bad_field_is_invalid_arg(server, expected_text, field, kwargs):
    call = dict(prompt=PROMPT, max_tokens=MAX_TOKENS) | kwargs
    with pytest.raises(client.GenerateError, match=field):
        list(client.generate_grpc(server.grpc_url, stream=True, **call))
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS)) == [expected_text]


@pytest.mark.parametrize("body", [b"", b"{not json", b"[1, 2]"])
def test_malformed_body_is_400(server, body):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 400 and "error" in json.loads(e.value.read())


@pytest.mark.parametrize("megabytes", [5, 50])
def test_huge_body_is_refused_and_the_server_lives(server, expected_text, megabytes):
    """A 4 MiB+ body crashes tritonserver 2.51 (signal 11, measured); the front refuses it first."""
    body = json.dumps({"text_input": "a" * (megabytes << 20), "max_tokens": 8}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    sock.sendall(
        f"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    try:
        sock.sendall(body)
    except OSError:
        pass  # the front may answer and close before reading it all
    reply = sock.recv(4096)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413")
    assert server.is_ready()
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS)) == [expected_text]


def test_long_prompt_is_refused_before_tokenizing(server):
    with pytest.raises(client.GenerateError, match="text_input.*bytes"):
        list(client.generate_grpc(server.grpc_url, "x" * (64 * MAX_SEQ_LEN), 4))


# ---- lifecycle (last: stops the module's server) ----


def test_stop_after_cancellations_is_quick_and_leaves_nothing(served):
    server = served[0]
    streams = [_grpc_stream(server, "ensemble", True, MAX_SEQ_LEN - 40) for _ in range(4)]
    for triton, responses in streams:
        responses.get(timeout=60)
        triton.stop_stream(cancel_requests=True)
        triton.close()
    wait_idle(server.metrics_url)
    triton_pid = server.triton_pids()[0]
    shm = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"dspark_{server.pid}_")]
    assert shm  # the Python backend's regions, named after this `dspark serve`
    took = server.stop()
    print(f"dspark serve stopped in {took:.1f} s after cancellations")
    assert server.process.returncode == 0
    assert "0 model versions that have in-flight inferences" in server.log_text()  # nothing left running
    assert took < 10, took  # model unloading included (measured ~3 s; the issue asks < 5 s)
    with pytest.raises(ProcessLookupError):
        os.kill(triton_pid, 0)
    assert process_group_members(triton_pid) == []
    assert not any(p.exists() for p in shm)


def echo_repository(repo: Path) -> Path:
    """A one-model repository (an int echo on the Python backend): `dspark serve` starts fast."""
    model = repo / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        x = [pb_utils.get_input_tensor_by_name(r, 'x').as_numpy() for r in requests]\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('y', v)]) for v in x]\n"
    )
    return repo


def test_serve_prints_its_binds_and_reports_a_dead_tritonserver(tmp_path):
    """`dspark serve` binds 127.0.0.1 by default and says so, marks the CPU-harmless CUDA lines,
    and exits non-zero naming the signal when tritonserver dies (here: SIGSEGV, as the 4 MiB
    body did), leaving no shared memory behind. A one-model repository keeps it quick."""
    echo_repository(tmp_path / "repo")
    srv = Serve("--model", "demo", repo=tmp_path / "repo", log=tmp_path / "serve.log").start()
    try:
        srv.wait_ready(120)
        log = srv.log_text()
        assert f"HTTP     http://127.0.0.1:{srv.http_port}" in log and "bound to this machine only" in log
        assert "CudaDriverHelper has not been initialized" not in log or "[harmless without a GPU" in log
        (triton_pid,) = srv.triton_pids()
        shm = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"dspark_{srv.pid}_")]
        os.kill(triton_pid, signal.SIGSEGV)
        assert srv.process.wait(60) == 1
        assert "error: tritonserver killed by SIGSEGV (a crash)" in srv.log_text()
        assert shm and not any(p.exists() for p in shm)
    finally:
        srv.stop()


def test_tritonserver_does_not_outlive_a_killed_dspark_serve(tmp_path):
    """`dspark serve` killed outright (SIGKILL: no cleanup can run in it) takes its tritonserver
    with it (PR_SET_PDEATHSIG -> SIGTERM, a graceful exit): no orphan keeps the ports."""
    echo_repository(tmp_path / "repo")
    srv = Serve("--model", "demo", repo=tmp_path / "repo", log=tmp_path / "serve.log").start()
    try:
        srv.wait_ready(120)
        (triton_pid,) = srv.triton_pids()
        srv.process.kill()
        srv.process.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(triton_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"tritonserver {triton_pid} outlived the killed dspark serve")
    finally:
        srv.stop()


def test_backend_dir_and_fail_fast_with_log(tmp_path):
    from dspark.serving.triton_server import TritonServer, prepare_backend_dir

    backends = prepare_backend_dir(tmp_path / "backends")
    names = sorted(p.name for p in (backends / "python").iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert os.access(backends / "python" / "triton_python_backend_stub", os.X_OK)
    model = tmp_path / "repo" / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise ValueError('broken on purpose')\n"
    )
    srv = TritonServer(tmp_path / "repo", http_port=0, grpc_port=0, metrics_port=0)
    with pytest.raises(RuntimeError, match="broken on purpose"):
        with srv:
            pass
    assert srv.process.poll() is not None
    assert not list(Path("/dev/shm").glob(srv.shm_prefix + "*"))


def test_server_env_bounds_onednn_cache_unless_set(monkeypatch):
    """tritonserver's models get oneDNN's primitive cache bounded (soak memory); a value the
    user set wins."""
    from dspark.serving.triton_server import server_env as triton_env

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert triton_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert triton_env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
