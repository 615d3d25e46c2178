"""The server on the real tritonserver (docs/architecture.md §10), running the speculative engine loop
(n-gram drafter, DSpark policy): the ensemble streams over gRPC and answers HTTP
`generate` with exactly the text of in-process greedy PLAIN decoding, batches more
requests than KV slots continuously, frees a slot on a stop string, exports the engine
counters on the metrics port, rejects bad input with INVALID_ARG naming the field while
staying ready, and stops by pid leaving no process behind."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from dspark.paths import MODEL_REPOSITORY, REPO_ROOT
from dspark.runtime.engine import SpecEngine
from dspark.runtime.target import TargetEngine
from dspark.runtime.text import decode, encode, load_tokenizer
from dspark.serving.triton_server import TritonServer, prepare_backend_dir

pytestmark = pytest.mark.integration

PROMPT = "def greet(name):\n    return"
MAX_TOKENS = 16
LONG_TOKENS = 100  # long enough for the n-gram drafter to get drafts accepted on the tiny target
MAX_SEQ_LEN = 128
CAPACITY = 2
GAMMA = 7


def load_client():
    path = REPO_ROOT / "clients" / "generate_client.py"
    spec = importlib.util.spec_from_file_location("generate_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


client = load_client()


def greedy_texts(ckpt: Path) -> dict[int, str]:
    """In-process greedy decoding of PROMPT, as text after n tokens: what the server must return."""
    engine = TargetEngine.from_pretrained(ckpt, capacity=1, max_seq_len=MAX_SEQ_LEN)
    ids = SpecEngine(engine).generate([encode(engine.tokenizer, PROMPT)], LONG_TOKENS)[0]
    return {n: decode(engine.tokenizer, ids[:n]) for n in range(1, LONG_TOKENS + 1)}


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    """(running server, expected text); the reference decode runs while the server loads.
    The synthetic GPU-shaped SPS table makes verification nearly free, so the DSpark policy
    verifies drafts whatever results/sps_cpu.json holds."""
    env = {"DSPARK_MODEL": str(tiny_ckpt), "DSPARK_CAPACITY": str(CAPACITY),
           "DSPARK_MAX_SEQ_LEN": str(MAX_SEQ_LEN), "DSPARK_NUM_THREADS": "1", "DSPARK_DEVICE": "cpu",
           "DSPARK_DRAFTER": "ngram", "DSPARK_POLICY": "dspark", "DSPARK_GAMMA": str(GAMMA),
           "DSPARK_SPS": "gpu_shaped", "DSPARK_DTYPE": "fp32"}
    srv = TritonServer(MODEL_REPOSITORY, http_port=0, grpc_port=0, metrics_port=0, host="127.0.0.1", env=env)
    srv.start()
    try:
        expected = greedy_texts(tiny_ckpt)
        srv.wait_ready(timeout=180)
        yield srv, expected
    finally:
        srv.stop()


@pytest.fixture
def server(served) -> TritonServer:
    return served[0]


@pytest.fixture
def expected_text(served) -> str:
    return served[1][MAX_TOKENS]


def test_grpc_stream_matches_in_process_greedy(server, expected_text):
    pieces = list(client.generate_grpc(server.grpc_url, PROMPT, MAX_TOKENS, stream=True))
    assert len(expected_text) > 0
    assert len(pieces) > 1  # really streamed
    assert "".join(pieces) == expected_text


def test_http_generate_matches_in_process_greedy(server, expected_text):
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS)) == [expected_text]


def test_http_generate_stream_and_stop_string(server, expected_text):
    pieces = list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS, stream=True))
    assert "".join(pieces) == expected_text
    stop = expected_text[3:5]
    cut = list(client.generate_grpc(server.grpc_url, PROMPT, MAX_TOKENS, stream=False, stop=[stop]))
    assert cut == [expected_text[: expected_text.find(stop)]]


def scrape(server: TritonServer) -> dict[str, float]:
    """dspark_* samples on the metrics port, keyed by name plus labels as printed."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = re.findall(r"^(dspark_\S+) (\S+)$", text, flags=re.MULTILINE)
    return {name: float(value) for name, value in samples}


def wait_idle(server: TritonServer, timeout: float = 60.0) -> dict[str, float]:
    """Metrics once no request is pending (the exporter refreshes every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        first = scrape(server)
        if first.get("dspark_pending_requests") == 0 and first.get("dspark_active_requests") == 0:
            time.sleep(0.6)  # one more refresh: counters of the last step are in
            second = scrape(server)
            if second == first:
                return second
        assert time.monotonic() < deadline, f"server never went idle: {first}"
        time.sleep(0.2)


def test_long_generation_accepts_drafts_and_metrics_count_them(served):
    server, expected = served
    before = wait_idle(server)
    assert list(client.generate_http(server.http_url, PROMPT, LONG_TOKENS)) == [expected[LONG_TOKENS]]
    after = wait_idle(server)
    counters = ("steps", "drafted_tokens", "verified_tokens", "accepted_tokens", "emitted_tokens")
    names = [f"dspark_{c}_total" for c in counters] + ["dspark_acceptance_length_count"]
    grew = {k: after[k] - before[k] for k in names}
    assert all(v > 0 for v in grew.values()), grew  # speculation happened, output still == plain greedy
    assert grew["dspark_emitted_tokens_total"] == LONG_TOKENS
    # every verify step of the one request is one histogram observation (the prefill token is not)
    assert grew["dspark_acceptance_length_count"] == grew["dspark_steps_total"]
    assert grew["dspark_steps_total"] < LONG_TOKENS - 1  # accepted drafts saved target steps
    assert grew["dspark_accepted_tokens_total"] <= grew["dspark_verified_tokens_total"]
    assert 0 <= after['dspark_position_acceptance{position="1"}'] <= 1
    assert f'dspark_position_acceptance{{position="{GAMMA}"}}' in after
    assert after["dspark_drafter_fallbacks_total"] == 0
    assert 0 <= after["dspark_verify_budget"] <= CAPACITY * GAMMA


def test_stop_string_frees_its_slot(served):
    server, expected = served
    text = expected[MAX_TOKENS]
    stop = text[3:5]
    before = wait_idle(server)
    cut = list(client.generate_grpc(server.grpc_url, PROMPT, LONG_TOKENS, stream=False, stop=[stop]))
    assert cut == [text[: text.find(stop)]]
    after = wait_idle(server)  # the request was cancelled in the engine, not decoded to LONG_TOKENS
    assert after["dspark_emitted_tokens_total"] - before["dspark_emitted_tokens_total"] <= MAX_TOKENS + GAMMA
    with ThreadPoolExecutor(CAPACITY) as pool:  # and its slot serves the next burst
        burst = [pool.submit(lambda: "".join(client.generate_grpc(server.grpc_url, PROMPT, MAX_TOKENS)))
                 for _ in range(CAPACITY)]
        assert [f.result(timeout=60) for f in burst] == [text] * CAPACITY


def test_client_cancel_stops_decoding(served, tiny_ckpt):
    """Called directly (2.51 does not pass a cancel through the ensemble), `dspark` notices
    a cancelled stream within CANCEL_CHECK_TOKENS and ends the request in the engine."""
    server, _ = served
    before = wait_idle(server)
    ids = np.array(encode(load_tokenizer(tiny_ckpt), PROMPT), dtype=np.int32)
    values = {"input_ids": ids, "max_tokens": np.array([LONG_TOKENS], dtype=np.int32),
              "stream": np.array([True])}
    inputs = []
    for name, value in values.items():
        inputs.append(grpcclient.InferInput(name, list(value.shape), "BOOL" if name == "stream" else "INT32"))
        inputs[-1].set_data_from_numpy(value)
    responses: queue.Queue = queue.Queue()
    triton = grpcclient.InferenceServerClient(server.grpc_url)
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    triton.async_stream_infer("dspark", inputs)
    first = [responses.get(timeout=30) for _ in range(2)]
    assert all(error is None for _, error in first)
    triton.stop_stream(cancel_requests=True)
    triton.close()
    after = wait_idle(server)
    assert after["dspark_emitted_tokens_total"] - before["dspark_emitted_tokens_total"] < LONG_TOKENS // 2


def test_concurrent_requests_each_get_their_own_text(served):
    server, expected = served
    lengths = [3, MAX_TOKENS, 7, 11]  # more requests than the KV slots: they join as slots free up
    with ThreadPoolExecutor(len(lengths)) as pool:
        grpc = [pool.submit(lambda n: "".join(client.generate_grpc(server.grpc_url, PROMPT, n)), n)
                for n in lengths]
        http = [pool.submit(lambda n: "".join(client.generate_http(server.http_url, PROMPT, n)), n)
                for n in lengths]
        assert [f.result() for f in grpc] == [f.result() for f in http] == [expected[n] for n in lengths]


def test_abandoned_stream_does_not_block_the_server(server, expected_text):
    # tritonserver 2.51 does not pass a gRPC stream cancel through the ensemble to `dspark`,
    # so the abandoned request decodes to its max_tokens and then frees its slot.
    stream = client.generate_grpc(server.grpc_url, PROMPT, MAX_SEQ_LEN - 20, stream=True)
    next(stream), next(stream)
    stream.close()  # the client stops reading: generate_grpc cancels its stream
    assert server.is_ready()
    assert "".join(client.generate_grpc(server.grpc_url, PROMPT, MAX_TOKENS)) == expected_text


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("top_p", dict(top_p=1.5)),
        ("temperature", dict(temperature=-1.0)),
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=10 * MAX_SEQ_LEN)),
        ("text_input", dict(prompt="")),
    ],
)
def test_bad_input_is_invalid_arg_and_server_stays_ready(server, expected_text, field, kwargs):
    call = dict(prompt=PROMPT, max_tokens=MAX_TOKENS) | kwargs
    with pytest.raises(client.GenerateError) as http_error:
        list(client.generate_http(server.http_url, **call))
    assert http_error.value.status == 400 and field in str(http_error.value)
    # a gRPC stream carries only the error message (ModelStreamInferResponse.error_message)
    with pytest.raises(client.GenerateError, match=field):
        list(client.generate_grpc(server.grpc_url, stream=True, **call))
    assert server.is_ready()
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS)) == [expected_text]


def process_group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_stop_by_pid_leaves_no_process(server):
    pid = server.pid
    assert len(process_group_members(pid)) >= 4  # the server + one stub per Python model
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert process_group_members(pid) == []


def test_backend_dir_and_fail_fast_with_log(tmp_path):
    backends = prepare_backend_dir(tmp_path / "backends")
    names = sorted(p.name for p in (backends / "python").iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert os.access(backends / "python" / "triton_python_backend_stub", os.X_OK)
    model = tmp_path / "repo" / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise ValueError('broken on purpose')\n")
    srv = TritonServer(tmp_path / "repo", http_port=0, grpc_port=0, metrics_port=0, host="127.0.0.1")
    with pytest.raises(RuntimeError, match="broken on purpose"):
        with srv:
            pass
    assert srv.process.poll() is not None


FAULT_INJECTION = '''

# --- test only: the target fails to prefill any prompt holding the <|mask|> token ---
_initialize = TritonPythonModel.initialize


def _initialize_with_fault(self, args):
    _initialize(self, args)
    prefill, poison = self.target.prefill, self.target.tokenizer.token_to_id("<|mask|>")

    def failing_prefill(slots, prompts):
        if any(poison in p for p in prompts):
            raise RuntimeError("injected target failure")
        return prefill(slots, prompts)

    self.target.prefill = failing_prefill


TritonPythonModel.initialize = _initialize_with_fault
'''


@pytest.mark.slow  # a second server: ~15-25 s on the shared CPU
def test_engine_failure_fails_pending_requests_once_and_keeps_serving(tmp_path, tiny_ckpt, served):
    """A step that raises answers every pending request with exactly one error; the next
    request decodes normally. The fault is injected into a copy of the repository."""
    _, expected = served
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY, repo, ignore=shutil.ignore_patterns("__pycache__"))
    model_py = repo / "dspark" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + FAULT_INJECTION)
    env = {"DSPARK_MODEL": str(tiny_ckpt), "DSPARK_CAPACITY": str(CAPACITY),
           "DSPARK_MAX_SEQ_LEN": str(MAX_SEQ_LEN), "DSPARK_NUM_THREADS": "1", "DSPARK_DEVICE": "cpu",
           "DSPARK_DRAFTER": "ngram", "DSPARK_SPS": "gpu_shaped", "DSPARK_DTYPE": "fp32"}
    # After concurrent requests fail together, tritonserver 2.51's ensemble sometimes keeps one
    # in-flight count (our model answered each exactly once: pending_requests is 0), so a
    # graceful stop would wait the whole default 30 s exit timeout.
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, host="127.0.0.1", env=env,
                      extra_args=["--exit-timeout-secs=3"]) as srv:
        long_stream = client.generate_grpc(srv.grpc_url, PROMPT, LONG_TOKENS, stream=True)
        pieces = [next(long_stream)]  # in flight when the failure happens
        with pytest.raises(client.GenerateError, match="generation failed.*injected target failure"):
            list(client.generate_http(srv.http_url, PROMPT + "<|mask|>", MAX_TOKENS))
        with pytest.raises(client.GenerateError, match="injected target failure"):
            pieces.extend(long_stream)  # its one final response is the error; nothing after it
        assert expected[LONG_TOKENS].startswith("".join(pieces))
        assert srv.is_ready()
        assert list(client.generate_http(srv.http_url, PROMPT, MAX_TOKENS)) == [expected[MAX_TOKENS]]
        wait_idle(srv, timeout=10)  # nothing left behind in the engine or the model
