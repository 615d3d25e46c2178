"""Faults inside the deployment, injected into a copy of the model repository and served by the
real tritonserver: a `drafter` model whose calls fail leaves every response exactly plain greedy
(each failed call is a counted fallback: those steps decode plain); a `target` step that raises
answers every pending request once with an error, and the next request decodes normally."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from serve_helpers import Serve, wait_idle
from test_server import LONG_TOKENS, MAX_TOKENS, PROMPT, greedy_texts, server_env

from dspark.paths import MODEL_REPOSITORY, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "clients"))
import generate_client as client  # noqa: E402

pytestmark = pytest.mark.integration

# Every propose of the drafter model raises; start / extend / release keep working.
DRAFTER_FAULT = """

# --- test only: the drafter model fails every propose call ---
def _failing_propose(*args, **kwargs):
    raise RuntimeError("injected drafter failure")


_initialize = TritonPythonModel.initialize


def _initialize_with_fault(self, args):
    _initialize(self, args)
    self.server.drafter.propose = _failing_propose


TritonPythonModel.initialize = _initialize_with_fault
"""

# The target fails to prefill any prompt holding the <|mask|> token.
TARGET_FAULT = """

# --- test only: the target fails to prefill any prompt holding the <|mask|> token ---
_initialize = TritonPythonModel.initialize


def _initialize_with_fault(self, args):
    _initialize(self, args)
    target = self.server.target
    prefill, poison = target.prefill, target.tokenizer.token_to_id("<|mask|>")

    def failing_prefill(slots, prompts):
        if any(poison in p for p in prompts):
            raise RuntimeError("injected target failure")
        return prefill(slots, prompts)

    target.prefill = failing_prefill


TritonPythonModel.initialize = _initialize_with_fault
"""


@pytest.fixture(scope="module")
def faulty(tiny_ckpt, tmp_path_factory):
    repo = tmp_path_factory.mktemp("faulty") / "repo"
    shutil.copytree(MODEL_REPOSITORY, repo, ignore=shutil.ignore_patterns("__pycache__"))
    for model, fault in (("drafter", DRAFTER_FAULT), ("target", TARGET_FAULT)):
        path = Path(repo / model / "1" / "model.py")
        path.write_text(path.read_text() + fault)
    srv = Serve(repo=repo, env=server_env(tiny_ckpt), log=repo.parent / "serve.log").start()
    try:
        expected = greedy_texts(tiny_ckpt)
        srv.wait_ready(300)
        yield srv, expected
    finally:
        srv.stop()


def test_failing_drafter_model_still_answers_exactly_and_is_counted(faulty):
    server, expected = faulty
    before = wait_idle(server.metrics_url)
    assert "".join(client.generate_grpc(server.grpc_url, PROMPT, LONG_TOKENS)) == expected[LONG_TOKENS]
    after = wait_idle(server.metrics_url)
    fallbacks = after["dspark_drafter_fallbacks_total"] - before["dspark_drafter_fallbacks_total"]
    steps = after["dspark_steps_total"] - before["dspark_steps_total"]
    assert fallbacks >= 1 and steps == LONG_TOKENS - 1  # every step decoded plain
    assert after["dspark_accepted_tokens_total"] == before["dspark_accepted_tokens_total"]


def test_failing_target_fails_pending_requests_once_and_keeps_serving(faulty):
    server, expected = faulty
    long_stream = client.generate_grpc(server.grpc_url, PROMPT, LONG_TOKENS, stream=True)
    pieces = [next(long_stream)]  # in flight when the failure happens
    with pytest.raises(client.GenerateError, match="generation failed.*injected target failure"):
        list(client.generate_http(server.http_url, PROMPT + "<|mask|>", MAX_TOKENS))
    with pytest.raises(client.GenerateError, match="injected target failure"):
        pieces.extend(long_stream)  # its one final response is the error; nothing after it
    assert expected[LONG_TOKENS].startswith("".join(pieces))
    assert server.is_ready()
    assert list(client.generate_http(server.http_url, PROMPT, MAX_TOKENS)) == [expected[MAX_TOKENS]]
    wait_idle(server.metrics_url, timeout=30)  # nothing left behind in the engine or the model
