"""The default model through Triton: SmolLM2-135M-Instruct served by `dspark serve` with a drafter
on (every step verifies drafts: policy fixed:3) answers, over the ensemble and the direct BLS
path, concurrently, exactly the text of the in-process engine's greedy plain decoding.
The drafter is the shipped dspark-markov, run by the separate `drafter` model on the target's
shared weights alone; DSPARK_TEST_DRAFTER picks another (e.g. ngram)."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import Serve, wait_idle

from dspark.paths import REPO_ROOT
from dspark.runtime.chat import ChatTemplate
from dspark.runtime.engine import SpecEngine
from dspark.runtime.text import decode, encode

sys.path.insert(0, str(REPO_ROOT / "clients"))
import generate_client as client  # noqa: E402

pytestmark = pytest.mark.integration

TOKENS = 32
DRAFTER = os.environ.get("DSPARK_TEST_DRAFTER", "dspark-markov")


@pytest.fixture(scope="module")
def prompts(smollm2_folder):
    chat = ChatTemplate.from_folder(smollm2_folder)
    return [
        "The capital of France is",
        chat.render(
            [{"role": "user", "content": "Write a Python function that checks if a number is prime."}]
        ),
        "def fibonacci(n):\n    ",
    ]


@pytest.fixture(scope="module")
def expected(smollm2_fp32, prompts):
    tok = smollm2_fp32.tokenizer
    plain = SpecEngine(smollm2_fp32)
    out = []
    for p in prompts:
        ids = plain.generate([encode(tok, p)], TOKENS)[0]
        out.append(decode(tok, [t for t in ids if t not in smollm2_fp32.eos_token_ids]))
    return out


def start_server(tmp_path_factory, dtype: str) -> Serve:
    log = tmp_path_factory.mktemp(f"serve_{dtype}") / "serve.log"
    return Serve(
        "--model",
        "smollm2",
        "--dtype",
        dtype,
        "--device",
        "cpu",
        "--drafter",
        DRAFTER,
        "--policy",
        "fixed:3",
        "--capacity",
        "4",
        "--max-seq-len",
        "640",
        "--num-threads",
        "1",
        log=log,
    ).start()


@pytest.fixture(scope="module")
def server(smollm2_folder, tmp_path_factory):
    srv = start_server(tmp_path_factory, "fp32")
    try:
        yield srv.wait_ready(600)
    finally:
        srv.stop()


def test_smollm2_greedy_through_triton_equals_in_process(server, prompts, expected):
    before = wait_idle(server.metrics_url)
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        ensemble = [
            pool.submit(lambda p: "".join(client.generate_grpc(server.grpc_url, p, TOKENS)), p)
            for p in prompts
        ]
        direct = [
            pool.submit(
                lambda p: "".join(client.generate_http(server.http_url, p, TOKENS, model="dspark")), p
            )
            for p in prompts
        ]
        assert [f.result(timeout=600) for f in ensemble] == expected
        assert [f.result(timeout=600) for f in direct] == expected
    after = wait_idle(server.metrics_url)
    assert (
        after["dspark_verified_tokens_total"] > before["dspark_verified_tokens_total"]
    )  # drafts were verified
    assert after["dspark_drafter_fallbacks_total"] == 0
    if DRAFTER != "ngram":  # a trained drafter gets drafts accepted on these prompts
        assert after["dspark_accepted_tokens_total"] > before["dspark_accepted_tokens_total"]
    assert "Paris" in expected[0]


def test_smollm2_bf16_drafter_gets_taps_through_bls(smollm2_folder, prompts, tmp_path_factory):
    """The served default dtype (bf16): the target's bf16 taps reach the `drafter` model, whose
    config declares them FP32 (the BLS sends float tensors as fp32), so no drafter call fails
    and drafts are accepted. A bf16 target used to fail every `drafter.start` (INVALID_ARG
    'taps' BF16 vs FP32): every request silently decoded plain."""
    srv = start_server(tmp_path_factory, "bf16")
    try:
        srv.wait_ready(600)
        before = wait_idle(srv.metrics_url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: "".join(client.generate_grpc(srv.grpc_url, p, TOKENS)), prompts))
        after = wait_idle(srv.metrics_url)
    finally:
        srv.stop()
    assert all(texts)
    assert after["dspark_drafter_fallbacks_total"] == before["dspark_drafter_fallbacks_total"]
    assert after["dspark_verified_tokens_total"] > before["dspark_verified_tokens_total"]
    if DRAFTER != "ngram":
        assert after["dspark_accepted_tokens_total"] > before["dspark_accepted_tokens_total"]
