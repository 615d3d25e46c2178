"""TensorRT-LLM's request format and the BLS forwarding, without a server: the ensemble config
declares exactly TensorRT-LLM's inputs (names and types), validation names the bad field, the
JSON check catches what tritonserver would wrap or 500 on, and calls survive the BLS codec."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dspark.paths import MODEL_REPOSITORY
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.interfaces import DraftBlock
from dspark.runtime.sampling import SamplingParams
from dspark.serving.bls import decode_call, decode_result, encode_call, encode_result
from dspark.serving.request_format import (
    INPUTS,
    Limits,
    RequestError,
    check_json_body,
    check_prompt_length,
    parse,
)

# The inputs of TensorRT-LLM's inflight_batcher_llm/ensemble/config.pbtxt (NVIDIA/TensorRT-LLM
# triton_backend, commit 2a9abd95), and the two names of the release paired with tritonserver
# 2.51 (tensorrtllm_backend v0.14.0: random_seed, min_length; v0.17: return_kv_cache_reuse_stats).
TRTLLM_ENSEMBLE_INPUTS = {
    "text_input": "TYPE_STRING",
    "decoder_text_input": "TYPE_STRING",
    "max_tokens": "TYPE_INT32",
    "num_return_sequences": "TYPE_INT32",
    "bad_words": "TYPE_STRING",
    "stop_words": "TYPE_STRING",
    "exclude_input_in_output": "TYPE_BOOL",
    "end_id": "TYPE_INT32",
    "pad_id": "TYPE_INT32",
    "top_k": "TYPE_INT32",
    "top_p": "TYPE_FP32",
    "temperature": "TYPE_FP32",
    "length_penalty": "TYPE_FP32",
    "repetition_penalty": "TYPE_FP32",
    "min_tokens": "TYPE_INT32",
    "presence_penalty": "TYPE_FP32",
    "frequency_penalty": "TYPE_FP32",
    "seed": "TYPE_UINT64",
    "return_log_probs": "TYPE_BOOL",
    "return_context_logits": "TYPE_BOOL",
    "return_generation_logits": "TYPE_BOOL",
    "return_perf_metrics": "TYPE_BOOL",
    "return_num_input_tokens": "TYPE_BOOL",
    "return_num_output_tokens": "TYPE_BOOL",
    "beam_width": "TYPE_INT32",
    "stream": "TYPE_BOOL",
    "prompt_embedding_table": "TYPE_FP16",
    "prompt_table_extra_id": "TYPE_UINT64",
    "prompt_vocab_size": "TYPE_INT32",
    "embedding_bias_words": "TYPE_STRING",
    "embedding_bias_weights": "TYPE_FP32",
    "lora_task_id": "TYPE_UINT64",
    "lora_weights": "TYPE_FP16",
    "lora_config": "TYPE_INT32",
    "guided_decoding_guide_type": "TYPE_STRING",
    "guided_decoding_guide": "TYPE_STRING",
    "random_seed": "TYPE_UINT64",
    "min_length": "TYPE_INT32",
    "return_kv_cache_reuse_stats": "TYPE_BOOL",
}
LIMITS = Limits(max_seq_len=128, vocab_size=1000)


def pbtxt_tensors(text: str, section: str) -> dict[str, tuple[str, bool]]:
    block = re.search(section + r" \[(.*?)\n\]", text, re.S).group(1)
    return {
        m[0]: (m[1], bool(m[2]))
        for m in re.findall(r'name: "(\w+)" data_type: (\w+) dims: \[[^\]]*\]( optional)?', block)
    }


def test_ensemble_declares_trtllm_inputs_exactly():
    text = (MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text()
    declared = pbtxt_tensors(text, "input")
    assert {k: t for k, (t, _) in declared.items()} == TRTLLM_ENSEMBLE_INPUTS
    assert [k for k, (_, optional) in declared.items() if not optional] == ["text_input", "max_tokens"]
    assert (
        int(re.search(r"max_batch_size: (\d+)", text).group(1)) > 0
    )  # a batch dimension, like TensorRT-LLM's
    assert set(declared) == set(INPUTS)
    outputs = pbtxt_tensors(text, "output")
    assert outputs["text_output"][0] == "TYPE_STRING" and outputs["num_output_tokens"][0] == "TYPE_INT32"


def request(**fields):
    values = {"text_input": np.array([[b"hello"]], dtype=np.object_), "max_tokens": np.array([[8]], np.int32)}
    for k, v in fields.items():
        values[k] = None if v is None else np.array([v] if isinstance(v, list) else [[v]])
    return lambda name: values.get(name)


def test_parse_reads_the_supported_fields():
    req = parse(
        request(
            temperature=np.float32(0.5),
            top_k=np.int32(5),
            top_p=np.float32(0.9),
            random_seed=np.uint64(7),
            stop_words=[b"\n\n", b"END"],
            stream=True,
            end_id=np.int32(3),
            exclude_input_in_output=True,
            beam_width=np.int32(1),
            repetition_penalty=np.float32(1.0),
        ),
        LIMITS,
    )
    assert (req.text, req.max_tokens, req.temperature, req.top_k, req.seed) == ("hello", 8, 0.5, 5, 7)
    assert req.stop_words == ["\n\n", "END"] and req.stream and req.end_id == 3 and req.exclude_input
    assert abs(req.top_p - 0.9) < 1e-6


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", np.float32(np.inf)),
        ("temperature", np.float32(-0.1)),
        ("temperature", np.float32(1e30)),
        ("top_p", np.float32(0.0)),
        ("top_p", np.float32(1.5)),
        ("top_k", np.int32(-1)),
        ("max_tokens", np.int32(0)),
        ("max_tokens", np.int32(1410065408)),
        ("beam_width", np.int32(2)),
        ("num_return_sequences", np.int32(3)),
        ("min_tokens", np.int32(5)),
        ("repetition_penalty", np.float32(1.2)),
        ("return_log_probs", True),
        ("bad_words", [b"x"]),
        ("lora_task_id", np.uint64(1)),
        ("guided_decoding_guide", b"{}"),
        ("end_id", np.int32(5000)),
        ("stop_words", [b""]),
    ],
)
def test_bad_or_unsupported_field_is_named(field, value):
    with pytest.raises(RequestError) as e:
        parse(request(**{field: value}), LIMITS)
    assert e.value.field == field and str(e.value).startswith(field)


def test_text_input_size_is_checked_before_tokenizing_and_length_after():
    with pytest.raises(RequestError, match="text_input: is 5000 bytes"):
        parse(
            lambda n: {
                "text_input": np.array([[b"x" * 5000]], np.object_),
                "max_tokens": np.array([[1]], np.int32),
            }.get(n),
            LIMITS,
        )
    req = parse(request(), LIMITS)
    req.prompt_ids = list(range(125))
    with pytest.raises(RequestError, match="max_tokens: 8 exceeds the 3 tokens left"):
        check_prompt_length(req, LIMITS)
    with pytest.raises(RequestError, match="seed or random_seed"):
        parse(request(seed=np.uint64(1), random_seed=np.uint64(2)), LIMITS)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 8.5}, "max_tokens"),
        ({"max_tokens": 1e10}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop_words": 3}, "stop_words"),
        ({"stop_words": ["a", 3]}, "stop_words"),
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": 1}, "stream"),
        ({"nope": 1}, "nope"),
    ],
)
def test_json_body_check_names_the_field(body, field):
    inputs = {k: (t, d) for k, (t, d) in INPUTS.items()}
    with pytest.raises(RequestError) as e:
        check_json_body({"text_input": "hi", "max_tokens": 4} | body, inputs)
    assert e.value.field == field
    check_json_body(
        {
            "text_input": "hi",
            "max_tokens": 4.0,
            "seed": 2**64 - 1,
            "stop_words": ["a"],
            "temperature": 0.7,
            "stream": False,
        },
        inputs,
    )


def test_bls_codec_round_trips_the_engine_calls():
    batch = RaggedBatch.from_requests([0, 3], [[5, 6, 7], [8]], [10, 2])
    message, tensors = encode_call("verify", (batch,), ["batch"])
    assert set(tensors) == {"tokens", "seq_idx", "positions", "cu_seqlens", "slots"}
    method, (back,) = decode_call(message, tensors)
    assert method == "verify" and all(
        torch.equal(getattr(back, f), getattr(batch, f))
        for f in ("tokens", "seq_idx", "positions", "cu_seqlens", "slots")
    )
    params = [SamplingParams(0.7, 5, 0.9, 3), SamplingParams()]
    message, tensors = encode_call(
        "propose",
        ([1, 2], torch.tensor([3, 4]), params, torch.rand(2, 4)),
        ["slots", "anchors", "params", "uniforms"],
    )
    _, args = decode_call(message, tensors)
    assert args[0] == [1, 2] and args[2] == params and torch.equal(args[3], tensors["uniforms"])
    logits = torch.randn(3, 11).to(torch.bfloat16)
    taps = [torch.randn(2, 4), torch.randn(5, 4)]
    message, tensors = encode_result((logits, taps))
    out_logits, out_taps = decode_result(message, tensors)
    assert out_logits.dtype == torch.bfloat16 and torch.equal(out_logits, logits)
    assert len(out_taps) == 2 and all(torch.equal(a, b) for a, b in zip(out_taps, taps))
    block = DraftBlock(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3))
    message, tensors = encode_result(block)
    assert isinstance(decode_result(message, tensors), DraftBlock)
    assert decode_result(*encode_result({"gamma": 7, "temps": [1.0, 2.0]})) == {
        "gamma": 7,
        "temps": [1.0, 2.0],
    }


def test_drafter_model_declares_every_output_a_draft_block_sends():
    """A hybrid's DraftBlock carries a third tensor (its rows' sources): the `drafter` model must
    declare out_0 .. out_2, or Triton drops out_2 and every propose fails on the BLS side."""
    block = DraftBlock(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3), torch.tensor([0, 1]))
    message, tensors = encode_result(block)
    back = decode_result(message, tensors)
    assert torch.equal(back.sources, block.sources)
    config = (MODEL_REPOSITORY / "drafter" / "config.pbtxt").read_text()
    declared = set(re.findall(r'name: "(out_\d+)"', config))
    assert set(tensors) <= declared, f"drafter/config.pbtxt lacks {set(tensors) - declared}"
    from dspark.serving.stubs import DRAFTER_OUTPUTS  # what the BLS side asks the drafter for

    assert set(tensors) <= set(DRAFTER_OUTPUTS) <= declared | {"result"}


def test_bls_codec_refuses_unknown_types():
    with pytest.raises(TypeError):
        encode_call("x", (object(),), ["a"])
    with pytest.raises(TypeError, match="refusing"):
        decode_call('{"method": "x", "args": [{"$dc": "Popen", "fields": {}}]}', {})
