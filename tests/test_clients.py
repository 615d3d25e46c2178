"""Every client against the real server (`dspark serve --openai`, the 10M demo target given a
ChatML chat template, n-gram drafter): the CLI in clients/ prints the text, then TTFT, tokens/s
and τ, and its README `--stop "\\n\\n"` example works as written; the `openai` Python client
gets /v1/models, /v1/completions and /v1/chat/completions, streamed or not, with the text of
in-process greedy decoding, OpenAI finish reasons and usage, and 400s naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import openai
import pytest
from serve_helpers import Serve

from dspark.paths import DEMO_TARGET, REPO_ROOT
from dspark.runtime.chat import ChatTemplate
from dspark.runtime.engine import SpecEngine
from dspark.runtime.target import TargetEngine
from dspark.runtime.text import decode, encode

pytestmark = pytest.mark.integration

PROMPT = "The old man walked"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
TOKENS = 48


@pytest.fixture(scope="module")
def demo_with_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / "target"
    shutil.copytree(DEMO_TARGET, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": CHATML}))
    return folder


@pytest.fixture(scope="module")
def greedy(demo_with_template):
    """text(prompt, n): in-process greedy plain decoding, the oracle for every client."""
    engine = TargetEngine.from_pretrained(demo_with_template, capacity=1, max_seq_len=512)
    plain = SpecEngine(engine)

    def text(prompt: str, n: int) -> str:
        ids = plain.generate([encode(engine.tokenizer, prompt)], n)[0]
        return decode(engine.tokenizer, [t for t in ids if t not in engine.eos_token_ids])

    return text


@pytest.fixture(scope="module")
def server(demo_with_template, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    srv = Serve(
        "--openai",
        "--model",
        str(demo_with_template),
        "--drafter",
        "ngram",
        "--capacity",
        "4",
        "--max-seq-len",
        "512",
        "--num-threads",
        "1",
        "--sps",
        "gpu_shaped",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        log=log,
    ).start()
    try:
        yield srv.wait_ready(300)
    finally:
        srv.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "clients" / "generate_client.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_prints_text_then_ttft_tokens_per_s_and_tau(server, greedy, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    out = run_cli(
        "--protocol", protocol, "--url", url, "--prompt", PROMPT, "--max-tokens", str(TOKENS), "--stream"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == greedy(PROMPT, TOKENS) + "\n"
    stats = out.stderr.strip().splitlines()[-1]
    assert (
        stats.startswith("TTFT ")
        and f"| {TOKENS} tokens in " in stats
        and "tokens/s" in stats
        and "| τ " in stats
    )


def test_cli_readme_stop_example_works_as_written(server, greedy):
    """clients/README.md: --stop "\\n\\n" (the shell passes backslash-n; the CLI reads it as a newline)."""
    full = greedy(PROMPT, 200)
    assert "\n\n" in full  # the demo target writes paragraphs
    out = run_cli(
        "--protocol",
        "http",
        "--url",
        server.http_url,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "200",
        "--stream",
        "--stop",
        "\\n\\n",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == full[: full.find("\n\n")] + "\n"
    readme = (REPO_ROOT / "clients" / "README.md").read_text()
    assert '--stop "\\n\\n"' in readme


def test_cli_reports_a_rejected_request(server):
    out = run_cli("--protocol", "grpc", "--url", server.grpc_url, "--prompt", PROMPT, "--max-tokens", "0")
    assert out.returncode == 1 and "max_tokens" in out.stderr


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def test_openai_models(oai):
    assert [m.id for m in oai.models.list()] == ["dspark"]


def test_openai_completions_greedy_stream_and_not(oai, greedy):
    expected = greedy(PROMPT, 20)
    r = oai.completions.create(model="dspark", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens > 0
    chunks = list(
        oai.completions.create(model="dspark", prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_chat_uses_the_models_template(oai, greedy, demo_with_template):
    prompt = ChatTemplate.from_folder(demo_with_template).render(MESSAGES, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    expected = greedy(prompt, 24)
    r = oai.chat.completions.create(model="dspark", messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    stream = oai.chat.completions.create(
        model="dspark",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 24


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(n=2), "n"),
        (dict(temperature=3.0), "temperature"),
        (dict(logprobs=2), "logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(model="gpt-4"), "model"),
    ],
)
def test_openai_bad_request_names_the_field(oai, kwargs, param):
    call = dict(model="dspark", prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        oai.completions.create(**call)
    assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="dspark", messages=[{"role": "user"}], max_tokens=4)
    assert "messages" in str(e.value)
