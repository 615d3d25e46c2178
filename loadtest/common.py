"""Shared parts of the load tests (docs/architecture.md §9, §10): AIPerf's per-request metrics,
token counting, prompts from the evaluation sets, the ensemble's request format as the
server declares it, server-sent-event parsing and the Prometheus scrape.

No locust or gevent import here, so the frontier/soak drivers and the tests use it as is.

AIPerf's definitions (per request; a streamed response may carry several tokens, so tokens
are counted in the text, never as responses):
- request latency = time of the last response - time the request was sent;
- TTFT = time of the first response with non-empty text - time sent;
- output tokens (OSL) = tokens of the whole output text, by the served model's tokenizer;
- ITL = (request latency - TTFT) / (OSL - 1), defined when OSL >= 2;
- output tokens/s per user = 1 / ITL;
- aggregate output tokens/s = sum of OSL / benchmark duration.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

MODEL = "ensemble"
# Logical field -> tensor names accepted for it, TensorRT-LLM's ensemble name first
# (triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt). Older revisions
# of that file (and of ours) use the later names.
FIELD_NAMES = {
    "text_input": ("text_input",),
    "max_tokens": ("max_tokens",),
    "stream": ("stream",),
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
    "seed": ("seed", "random_seed"),
    "stop_words": ("stop_words", "stop"),
}
NUMPY_TYPES = {
    "BYTES": np.object_,
    "BOOL": np.bool_,
    "INT32": np.int32,
    "UINT32": np.uint32,
    "INT64": np.int64,
    "UINT64": np.uint64,
    "FP32": np.float32,
    "FP16": np.float16,
}


# ---------------------------------------------------------------- per-request metrics


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds (`start` is epoch time)."""

    user: str  # the user class / endpoint, e.g. "grpc_stream"
    start: float
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    responses: int = 0  # responses (chunks) received, for comparison with output_tokens
    error: str | None = None
    kind: str = "ok"  # ok | error | cancelled | bad_request (the soak's deliberate cases)
    text: str = field(default="", repr=False)

    @property
    def itl_s(self) -> float | None:
        if self.error or self.latency_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_s_user(self) -> float | None:
        itl = self.itl_s
        return 1.0 / itl if itl else None

    def row(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "text"}
        d["itl_s"], d["tokens_per_s_user"] = self.itl_s, self.tokens_per_s_user
        return d


class StreamTimer:
    """Times one request: call `response(text)` for every response as it arrives (text may be
    empty, e.g. Triton's empty final response), then `finish(count_tokens)`."""

    def __init__(self, user: str):
        self.record = RequestRecord(user=user, start=time.time())
        self._t0 = time.perf_counter()
        self._last = self._t0
        self._pieces: list[str] = []

    def response(self, text: str) -> None:
        now = time.perf_counter()
        self._last = now
        self.record.responses += 1
        if text:
            if self.record.ttft_s is None:
                self.record.ttft_s = now - self._t0
            self._pieces.append(text)

    def finish(self, count_tokens, error: str | None = None, kind: str | None = None) -> RequestRecord:
        r = self.record
        r.latency_s = self._last - self._t0 if r.responses else time.perf_counter() - self._t0
        r.text = "".join(self._pieces)
        r.output_tokens = count_tokens(r.text) if r.text else 0
        r.error = error
        r.kind = kind or ("error" if error else "ok")
        return r


class TokenCounter:
    """Counts tokens of output text with the served model's tokenizer (tokenizer.json of a
    Hugging Face folder), as AIPerf does by default."""

    def __init__(self, model_folder: str | Path):
        from tokenizers import Tokenizer

        path = Path(model_folder)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path}")
        self.tokenizer = Tokenizer.from_file(str(path))

    def __call__(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """AIPerf-style aggregate of finished requests: p50/p90/p99 of each per-request metric,
    the mean per-user tokens/s and the aggregate output tokens/s over `duration_s`."""
    ok = [r for r in records if r.kind == "ok"]
    out: dict = {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(r.kind == "error" for r in records),
        "duration_s": duration_s,
        "output_tokens": sum(r.output_tokens for r in ok),
        "responses": sum(r.responses for r in ok),
    }
    out["aggregate_tokens_per_s"] = out["output_tokens"] / duration_s if duration_s > 0 else None
    series = {
        "ttft_ms": [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
        "itl_ms": [r.itl_s * 1e3 for r in ok if r.itl_s is not None],
        "request_latency_ms": [r.latency_s * 1e3 for r in ok if r.latency_s is not None],
        "tokens_per_s_user": [r.tokens_per_s_user for r in ok if r.tokens_per_s_user is not None],
        "output_tokens": [float(r.output_tokens) for r in ok],
    }
    for name, values in series.items():
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q)
        out[f"{name}_mean"] = float(np.mean(values)) if values else None
    return out


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(RequestRecord) if f.name != "text"] + ["itl_s", "tokens_per_s_user"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in records:
            writer.writerow(r.row())


def read_records(path: str | Path) -> list[RequestRecord]:
    """Records written by `write_records` (derived columns are recomputed)."""
    out = []
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            out.append(
                RequestRecord(
                    user=row["user"],
                    start=float(row["start"]),
                    latency_s=_float_or_none(row["latency_s"]),
                    ttft_s=_float_or_none(row["ttft_s"]),
                    output_tokens=int(row["output_tokens"]),
                    responses=int(row["responses"]),
                    error=row["error"] or None,
                    kind=row["kind"],
                )
            )
    return out


def _float_or_none(value: str) -> float | None:
    return float(value) if value not in (None, "") else None


# ---------------------------------------------------------------- prompts


def load_prompts(spec: str, per_set: int | None = None, max_chars: int = 0, seed: int = 0) -> list[str]:
    """Prompts of the evaluation sets: `spec` is a comma list of domains of
    `dspark.tools.prompts` (code = HumanEval, math, prose) or a JSONL file of
    {"prompt": ...} / {"turns": [...]} lines (`dspark eval --prompts` format). Domains are
    interleaved; `max_chars` > 0 keeps the first max_chars characters of each prompt."""
    from dspark.tools.prompts import load_prompt_set, load_prompts_jsonl

    if spec.endswith(".jsonl") or Path(spec).is_file():
        prompts = load_prompts_jsonl(spec)[:per_set]
    else:
        sets = [load_prompt_set(d.strip(), per_set) for d in spec.split(",") if d.strip()]
        prompts = [p for group in zip(*sets) for p in group] if sets else []
    prompts = [p[:max_chars] if max_chars > 0 else p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"--prompts {spec!r}: no prompts")
    random.Random(seed).shuffle(prompts)
    return prompts


# ---------------------------------------------------------------- the ensemble's request format


@dataclass
class TensorSpec:
    name: str
    datatype: str
    batched: bool  # the model has max_batch_size > 0: a leading batch dimension of 1


class EnsembleFormat:
    """The ensemble's inputs as the server declares them (model metadata + config), so the
    same users speak TensorRT-LLM's format (batched, `seed`, INT32 `max_tokens`, ...) and
    earlier variants of it; a logical field the model lacks is never sent."""

    def __init__(self, metadata: dict, config: dict):
        batched = int(config.get("max_batch_size", 0) or 0) > 0
        declared = {t["name"]: t["datatype"] for t in metadata.get("inputs", [])}
        self.outputs = {t["name"] for t in metadata.get("outputs", [])}
        self.inputs: dict[str, TensorSpec] = {}
        for logical, candidates in FIELD_NAMES.items():
            for name in candidates:
                if name in declared:
                    self.inputs[logical] = TensorSpec(name, declared[name], batched)
                    break
        missing = [f for f in ("text_input", "max_tokens") if f not in self.inputs]
        if missing:
            raise ValueError(f"model {MODEL!r} declares no input {missing}; declared: {sorted(declared)}")

    @classmethod
    def from_http(cls, base_url: str, timeout: float = 10) -> EnsembleFormat:
        base = http_base(base_url)
        with urllib.request.urlopen(f"{base}/v2/models/{MODEL}", timeout=timeout) as r:
            metadata = json.load(r)
        with urllib.request.urlopen(f"{base}/v2/models/{MODEL}/config", timeout=timeout) as r:
            config = json.load(r)
        return cls(metadata, config)

    @classmethod
    def from_grpc(cls, client) -> EnsembleFormat:
        """From a `tritonclient.grpc.InferenceServerClient`."""
        metadata = client.get_model_metadata(MODEL, as_json=True)
        config = client.get_model_config(MODEL, as_json=True).get("config", {})
        return cls(metadata, config)

    def fields(self, params: dict) -> dict[str, object]:
        """{tensor name: value} of the logical `params` the model accepts (None values dropped)."""
        return {self.inputs[k].name: v for k, v in params.items() if v is not None and k in self.inputs}

    def json_body(self, params: dict) -> dict:
        """Body of HTTP `generate` / `generate_stream` (the server converts JSON by datatype)."""
        return self.fields(params)

    def grpc_inputs(self, params: dict) -> list:
        import tritonclient.grpc as grpcclient

        inputs = []
        for logical, value in params.items():
            if value is None or logical not in self.inputs:
                continue
            spec = self.inputs[logical]
            values = value if isinstance(value, list) else [value]
            values = [v.encode() if isinstance(v, str) else v for v in values]
            array = np.array(values, dtype=NUMPY_TYPES[spec.datatype])
            if spec.batched:
                array = array.reshape(1, -1)
            tensor = grpcclient.InferInput(spec.name, list(array.shape), spec.datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs


def http_base(url: str) -> str:
    return url.rstrip("/") if url.startswith("http") else f"http://{url.rstrip('/')}"


def text_of(output) -> str:
    """text_output of one response (a numpy array of bytes, any shape) as str."""
    if output is None:
        return ""
    items = np.asarray(output).reshape(-1)
    return "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in items)


def iter_sse(lines: Iterable[bytes | str]) -> Iterator[str]:
    """Payloads of server-sent events ("data: ..." lines), in order."""
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        line = line.strip()
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


# ---------------------------------------------------------------- server metrics


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)")


def scrape(metrics_url: str, timeout: float = 10) -> dict[str, float]:
    """Every sample of a Prometheus text page, keyed by name plus labels as printed."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        text = r.read().decode()
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            value = float(m.group(3))
            if math.isfinite(value) or m.group(3) in ("+Inf", "-Inf"):
                out[m.group(1) + (m.group(2) or "")] = value
    return out


def metric_sum(samples: dict[str, float], name: str) -> float:
    """Sum of the samples of one metric over all its label sets (0 when absent)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def metric_names(text: str) -> set[str]:
    """Names of the metric families and samples on a Prometheus text page."""
    names = {m.group(1) for m in map(_SAMPLE.match, text.splitlines()) if m}
    names |= set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    return names


def locust_command(locustfile: Path, users: int, run_time_s: float, host: str, grpc_url: str, out: Path,
                   args, extra: list[str]) -> list[str]:
    """A headless Locust run of `locustfile` (`users` users, all spawned at once) against one
    server, with the prompt / tokenizer settings of `args` and CSV + per-request records at
    `out`; `extra` = further flags and the user classes."""
    return [
        str(Path(sys.executable).parent / "locust"), "-f", str(locustfile), "--headless",
        "-u", str(users), "-r", str(users), "--run-time", f"{int(run_time_s)}s",
        "--host", host, "--grpc-url", grpc_url,
        "--tokenizer", args.tokenizer, "--prompts", args.prompts,
        "--max-tokens", str(args.max_tokens), "--max-prompt-chars", str(args.max_prompt_chars),
        "--csv", str(out), "--records-csv", f"{out}_records.csv", "--only-summary",
        *extra,
    ]
