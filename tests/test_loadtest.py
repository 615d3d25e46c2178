"""The load tests (loadtest/): AIPerf's per-request metrics count tokens, not responses; the
users speak the ensemble's request format as the server declares it (TensorRT-LLM's,
batched, and the unbatched variant); and a short headless Locust run against the real
tritonserver (tiny checkpoint, free ports, stopped by pid) writes Locust's CSV with TTFT,
ITL and per-user tokens/s rows, our per-request records and the summary, with no failure."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark import wiring
from dspark.paths import MODEL_REPOSITORY, REPO_ROOT
from dspark.serving.triton_server import TritonServer

sys.path.insert(0, str(REPO_ROOT / "loadtest"))
import common  # noqa: E402

LOCUST = Path(sys.executable).parent / "locust"

# TensorRT-LLM's ensemble inputs as its config.pbtxt declares them (names, types; batched).
TRTLLM_METADATA = {
    "inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [-1, 1]},
        {"name": "bad_words", "datatype": "BYTES", "shape": [-1, -1]},
        {"name": "stop_words", "datatype": "BYTES", "shape": [-1, -1]},
        {"name": "end_id", "datatype": "INT32", "shape": [-1, 1]},
        {"name": "top_k", "datatype": "INT32", "shape": [-1, 1]},
        {"name": "top_p", "datatype": "FP32", "shape": [-1, 1]},
        {"name": "temperature", "datatype": "FP32", "shape": [-1, 1]},
        {"name": "seed", "datatype": "UINT64", "shape": [-1, 1]},
        {"name": "stream", "datatype": "BOOL", "shape": [-1, 1]},
    ],
    "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1, -1]}],
}


def test_itl_counts_tokens_not_responses(tiny_tokenizer_path):
    """One response carrying many tokens: OSL is the token count of the text, and ITL spreads
    the time after the first token over OSL - 1 tokens (AIPerf)."""
    count = common.TokenCounter(tiny_tokenizer_path)
    text = "the quick brown fox jumps over the lazy dog " * 3
    n = count(text)
    assert n > 5
    timer = common.StreamTimer("x")
    timer.response("")  # an empty first response does not start TTFT
    timer.response("the")
    timer.response(text[3:])
    timer.response("")  # the empty final response
    r = timer.finish(count)
    assert r.responses == 4 and r.output_tokens == n
    assert 0 < r.ttft_s <= r.latency_s
    assert r.itl_s == pytest.approx((r.latency_s - r.ttft_s) / (n - 1))
    assert r.tokens_per_s_user == pytest.approx(1 / r.itl_s)


def test_summary_aggregates_like_aiperf():
    records = [
        common.RequestRecord("a", 0.0, latency_s=1.0, ttft_s=0.1, output_tokens=10),
        common.RequestRecord("a", 0.0, latency_s=2.0, ttft_s=0.2, output_tokens=19),
        common.RequestRecord("a", 0.0, latency_s=0.5, output_tokens=1),  # no ITL with one token
        common.RequestRecord("a", 0.0, latency_s=0.1, error="boom", kind="error"),
    ]
    s = common.summarize(records, duration_s=3.0)
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["aggregate_tokens_per_s"] == pytest.approx(30 / 3.0)
    assert s["itl_ms_p50"] == pytest.approx(100.0)  # both are (lat - ttft) / (osl - 1) = 0.1 s
    assert s["tokens_per_s_user_mean"] == pytest.approx(10.0)
    assert s["ttft_ms_p50"] == pytest.approx(150.0)


def test_records_round_trip(tmp_path):
    rec = [
        common.RequestRecord("grpc_stream", 12.5, latency_s=1.0, ttft_s=0.1, output_tokens=10, responses=4),
        common.RequestRecord("http_stream", 13.0, latency_s=0.2, error="HTTP 400: bad", kind="error"),
    ]
    common.write_records(tmp_path / "r.csv", rec)
    back = common.read_records(tmp_path / "r.csv")
    assert [r.row() for r in back] == [r.row() for r in rec]


def test_trtllm_format_is_batched_with_declared_types():
    fmt = common.EnsembleFormat(TRTLLM_METADATA, {"max_batch_size": 64})
    params = {
        "text_input": "hi",
        "max_tokens": 8,
        "stream": True,
        "seed": 3,
        "stop_words": ["\n\n", "END"],
        "temperature": None,
    }
    inputs = {t.name(): t for t in fmt.grpc_inputs(params)}
    assert set(inputs) == {"text_input", "max_tokens", "stream", "seed", "stop_words"}
    assert inputs["max_tokens"].datatype() == "INT32" and inputs["max_tokens"].shape() == [1, 1]
    assert inputs["seed"].datatype() == "UINT64"
    assert inputs["stop_words"].shape() == [1, 2]
    assert fmt.json_body(params) == {
        "text_input": "hi",
        "max_tokens": 8,
        "stream": True,
        "seed": 3,
        "stop_words": ["\n\n", "END"],
    }


def test_unbatched_variant_and_missing_fields():
    meta = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1]},
            {"name": "max_tokens", "datatype": "UINT32", "shape": [1]},
            {"name": "random_seed", "datatype": "UINT64", "shape": [1]},
        ]
    }
    fmt = common.EnsembleFormat(meta, {"max_batch_size": 0})
    params = {"text_input": "hi", "max_tokens": 4, "seed": 1, "top_k": 5}
    inputs = {t.name(): t for t in fmt.grpc_inputs(params)}
    assert set(inputs) == {"text_input", "max_tokens", "random_seed"}  # top_k is not declared: not sent
    assert inputs["max_tokens"].shape() == [1] and inputs["max_tokens"].datatype() == "UINT32"
    with pytest.raises(ValueError, match="max_tokens"):
        common.EnsembleFormat({"inputs": meta["inputs"][:1]}, {})


def test_sse_and_prometheus_parsing():
    lines = [
        b'data: {"text_output": "a"}',
        b"",
        b": comment",
        'data: {"text_output": "b c"}',
        b"data: [DONE]",
    ]
    assert list(common.iter_sse(lines)) == ['{"text_output": "a"}', '{"text_output": "b c"}', "[DONE]"]
    text = (
        '# HELP x_total doc\n# TYPE x_total counter\nx_total{model="m"} 3\ny 2.5\n'
        '# TYPE h histogram\nh_bucket{le="+Inf"} 4\n'
    )
    samples = common.parse_metrics(text)
    assert samples == {'x_total{model="m"}': 3.0, "y": 2.5, 'h_bucket{le="+Inf"}': 4.0}
    assert common.metric_sum(samples, "x_total") == 3.0 and common.metric_sum(samples, "x") == 0
    assert {"x_total", "y", "h", "h_bucket"} <= common.metric_names(text)
    assert common.text_of(np.array([[b"caf\xc3\xa9", b"!"]], dtype=object)) == "café!"


def test_prompts_come_from_the_eval_sets():
    from dspark.tools.prompts import load_prompt_set

    prompts = common.load_prompts("code,math", per_set=3, max_chars=50, seed=1)
    assert len(prompts) == 6 and all(0 < len(p) <= 50 for p in prompts)
    expected = {p[:50] for d in ("code", "math") for p in load_prompt_set(d, 3)}
    assert set(prompts) == expected
    with pytest.raises((ValueError, FileNotFoundError)):
        common.load_prompts("nope")


# ---------------------------------------------------------------- against the real server


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    settings = {
        "model": str(tiny_ckpt),
        "capacity": "4",
        "max_seq_len": "256",
        "num_threads": "1",
        "device": "cpu",
        "dtype": "fp32",
        "drafter": "ngram",
        "policy": "dspark",
        "sps": "gpu_shaped",
    }
    env = {wiring.ENV_VARS[k]: v for k, v in settings.items()}
    srv = TritonServer(MODEL_REPOSITORY, http_port=0, grpc_port=0, metrics_port=0, host="127.0.0.1", env=env)
    srv.start()
    try:
        srv.wait_ready(timeout=180)
        yield srv
    finally:
        srv.stop()


@pytest.mark.integration
def test_locust_headless_run_against_triton(server, tiny_ckpt, tmp_path):
    before = common.scrape(server.metrics_url)
    out = tmp_path / "run"
    cmd = [
        str(LOCUST),
        "-f",
        str(REPO_ROOT / "loadtest" / "locustfile.py"),
        "--headless",
        "-u",
        "2",
        "-r",
        "2",
        "--run-time",
        "6s",
        "--host",
        f"http://{server.http_url}",
        "--grpc-url",
        server.grpc_url,
        "--tokenizer",
        str(tiny_ckpt),
        "--prompts",
        "math,prose",
        "--max-prompt-chars",
        "120",
        "--max-tokens",
        "24",
        "--csv",
        str(out),
        "--records-csv",
        str(tmp_path / "records.csv"),
        "--summary-json",
        str(tmp_path / "summary.json"),
        "--only-summary",
        "GrpcStreamUser",
        "HttpStreamUser",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    with open(f"{out}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for key in [
        ("gRPC", "ensemble stream"),
        ("HTTP", "generate_stream"),
        ("TTFT", "ensemble stream"),
        ("ITL", "generate_stream"),
        ("TOKENS_PER_S_USER", "ensemble stream"),
    ]:
        assert key in rows, sorted(rows)
        assert int(rows[key]["Request Count"]) > 0 and int(rows[key]["Failure Count"]) == 0

    records = common.read_records(tmp_path / "records.csv")
    assert {r.user for r in records} == {"grpc_stream", "http_stream"}
    assert all(r.kind == "ok" and 0 < r.output_tokens for r in records), [r for r in records if r.error][:3]
    assert all(r.ttft_s <= r.latency_s for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    total = sum(r.output_tokens for r in records)
    assert summary["all"]["output_tokens"] == total
    assert summary["all"]["aggregate_tokens_per_s"] == pytest.approx(total / summary["all"]["duration_s"])

    after = common.scrape(server.metrics_url)
    # the server really served them: it emitted at least as many tokens as the clients counted
    # requests (counts differ by re-tokenization of the text, not by much)
    emitted = common.metric_sum(after, "dspark_emitted_tokens_total") - common.metric_sum(
        before, "dspark_emitted_tokens_total"
    )
    assert emitted >= len(records)


@pytest.mark.slow
def test_frontier_smoke_on_the_demo_model(tmp_path):
    """loadtest/frontier.py end to end for seconds: two policies, two concurrency levels."""
    out = tmp_path / "live_frontier.json"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "loadtest" / "frontier.py"),
        "--model",
        "demo",
        "--drafter",
        "ngram",
        "--policies",
        "none,dspark",
        "--concurrency",
        "1,2",
        "--duration",
        "3",
        "--warmup",
        "2",
        "--max-tokens",
        "16",
        "--max-prompt-chars",
        "200",
        "--sps",
        "gpu_shaped",
        "--num-threads",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for policy in ("none", "dspark"):
        for c in ("1", "2"):
            point = result["by_policy"][policy][c]
            assert point["errors"] == 0 and point["aggregate_tokens_per_s"] > 0 and point["requests"] > 0
    assert result["by_policy"]["none"]["1"]["verified_per_request"] == 0  # plain decoding verifies no draft
    assert result["by_policy"]["dspark"]["1"]["verified_per_request"] > 0
    assert "per_concurrency" in result["goals"] and "live_over_simulated" in result["simulator"]
    assert all((tmp_path / Path(p).name).is_file() for p in result["plots"])


@pytest.mark.slow
def test_soak_smoke_on_the_demo_model(tmp_path):
    """loadtest/soak.py for seconds: every request answered or cleanly refused, slots free after."""
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "loadtest" / "soak.py"),
        "--model",
        "demo",
        "--drafter",
        "ngram",
        "--capacity",
        "2",
        "--users",
        "6",
        "--duration",
        "8",
        "--warmup",
        "3",
        "--max-tokens",
        "16",
        "--max-prompt-chars",
        "200",
        "--sps",
        "gpu_shaped",
        "--sample-every",
        "2",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    result = json.loads(out.read_text())
    assert result["requests"] > 0 and sum(result["by_kind"].values()) == result["requests"]
    for mem in (result["memory_mb_before"], result["memory_mb_after"]):
        # tritonserver + its Python stubs; shared pages counted once in PSS, per process in RSS
        assert len(mem["by_process"]) >= 2 and 0 < mem["pss"] <= mem["rss"]
        assert mem["anon"] > 0 and mem["pss"] == pytest.approx(sum(mem["by_process"].values()), abs=1)
    assert result["memory_timeline"] and result["memory_timeline"][0]["rss"] > 0
    assert result["unexpected_failures"] == 0, result["unexpected_examples"]
    assert result["slots_in_use_after"] == 0 and result["shm_regions_after"] == 0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.integration
def test_openai_and_front_users_against_dspark_serve(tiny_ckpt, tmp_path):
    """`dspark serve --openai` (the real front + tritonserver): the OpenAI user (chat and text
    completions, streamed) and the HTTP user through the front, headless, no failure."""
    import shutil
    import signal
    import time
    import urllib.request

    from dspark.serving.triton_server import free_port

    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps(config | {"chat_template": CHATML}))
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "dspark.cli",
        "serve",
        "--openai",
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
        "--model",
        str(model),
        "--capacity",
        "2",
        "--max-seq-len",
        "256",
        "--num-threads",
        "1",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--drafter",
        "ngram",
        "--sps",
        "gpu_shaped",
    ]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "dspark serve --openai not ready"
            time.sleep(1)
        out = tmp_path / "run"
        cmd = [
            str(LOCUST),
            "-f",
            str(REPO_ROOT / "loadtest" / "locustfile.py"),
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "--run-time",
            "6s",
            "--host",
            f"http://127.0.0.1:{http}",
            "--grpc-url",
            f"127.0.0.1:{grpc}",
            "--tokenizer",
            str(model),
            "--prompts",
            "math",
            "--max-prompt-chars",
            "100",
            "--max-tokens",
            "16",
            "--csv",
            str(out),
            "--records-csv",
            str(tmp_path / "records.csv"),
            "--only-summary",
            "OpenAIUser",
            "HttpStreamUser",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    with open(f"{out}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for key in [
        ("OpenAI", "/v1/chat/completions"),
        ("OpenAI", "/v1/completions"),
        ("HTTP", "generate_stream"),
        ("TTFT", "/v1/chat/completions"),
        ("ITL", "/v1/completions"),
    ]:
        assert key in rows and int(rows[key]["Request Count"]) > 0, sorted(rows)
        assert int(rows[key]["Failure Count"]) == 0
    records = common.read_records(tmp_path / "records.csv")
    assert {"openai_chat", "openai_completion", "http_stream"} <= {r.user for r in records}
