"""The Grafana dashboard (build/grafana/dspark-dashboard.json) and the autoscaling metric
(build/helm/prometheus-adapter-values.yaml) query only metrics the server really exports:
every PromQL expression is parsed (promql-parser) and each metric it selects is checked
against a live /metrics scrape of the real tritonserver (tiny checkpoint, n-gram drafter,
after a few requests; free ports, stopped by pid)."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request

import promql_parser
import pytest
import yaml

from dspark import wiring
from dspark.paths import MODEL_REPOSITORY, REPO_ROOT
from dspark.serving.triton_server import TritonServer

sys.path.insert(0, str(REPO_ROOT / "loadtest"))
import common  # noqa: E402

DASHBOARD = REPO_ROOT / "build" / "grafana" / "dspark-dashboard.json"
ADAPTER = REPO_ROOT / "build" / "helm" / "prometheus-adapter-values.yaml"
# Grafana / prometheus-adapter template variables -> something PromQL parses.
SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$namespace": ".*",
    "<<.GroupBy>>": "pod",
    "<<.LabelMatchers>>": 'namespace="x"',
}
# What the dashboard must show (issue 14 item 6) -> a pattern one of its metrics matches.
TOPICS = {
    "tokens/s": r"dspark_emitted_tokens_total",
    "τ": r"dspark_acceptance_length_count",
    "per-position acceptance": r"dspark_position_acceptance",
    "verify budget": r"dspark_verify_budget",
    "queue": r"dspark_pending_requests",
}
# Shown as soon as the server exports them (the dashboard test then requires a panel).
WHEN_EXPORTED = {
    "TTFT": r"dspark_\w*(ttft|time_to_first)\w*",
    "ITL": r"dspark_\w*(itl|inter_token)\w*",
    "cancellations": r"dspark_\w*cancel\w*",
}


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    return expr


def selected_metrics(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(substitute(expr)), visit)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target and query variable."""
    d = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["definition"])
            assert m, var["definition"]
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def adapter_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    return [(r["name"]["as"], q) for r in rules for q in (r["seriesQuery"], r["metricsQuery"])]


def test_dashboard_structure():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    assert {v["name"] for v in d["templating"]["list"]} >= {"datasource"}


def test_every_query_parses():
    for title, expr in dashboard_queries() + adapter_queries():
        assert selected_metrics(expr), f"{title}: selects no metric: {expr}"
    with pytest.raises(Exception):  # noqa: B017 - the parser rejects broken PromQL
        promql_parser.parse("sum(rate(dspark_steps_total[1m])")


def test_dashboard_covers_the_required_topics():
    used = set().union(*(selected_metrics(e) for _, e in dashboard_queries()))
    for topic, pattern in TOPICS.items():
        assert any(re.fullmatch(pattern, m) for m in used), f"no panel for {topic}"


@pytest.fixture(scope="module")
def scrape_text(tiny_ckpt) -> str:
    settings = {
        "model": str(tiny_ckpt),
        "capacity": "2",
        "max_seq_len": "128",
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
        fmt = common.EnsembleFormat.from_http(srv.http_url)
        for prompt in ("def add(a, b):\n    return a + b\n\ndef add(", "one two one two one two"):
            body = json.dumps(fmt.json_body({"text_input": prompt, "max_tokens": 24})).encode()
            request = urllib.request.Request(
                f"http://{srv.http_url}/v2/models/ensemble/generate",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as r:
                assert r.status == 200
        time.sleep(1.2)  # the engine metrics refresh every 0.5 s
        with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
            return r.read().decode()
    finally:
        srv.stop()


@pytest.mark.integration
def test_every_queried_metric_is_exported(scrape_text):
    exported = common.metric_names(scrape_text)
    assert "dspark_steps_total" in exported
    for title, expr in dashboard_queries() + adapter_queries():
        missing = selected_metrics(expr) - exported
        assert not missing, f"{title}: {sorted(missing)} not in the server's /metrics"


@pytest.mark.integration
def test_exported_latency_and_cancellation_metrics_have_panels(scrape_text):
    exported = common.metric_names(scrape_text)
    used = set().union(*(selected_metrics(e) for _, e in dashboard_queries()))
    for topic, pattern in WHEN_EXPORTED.items():
        if any(re.fullmatch(pattern, m) for m in exported):
            assert any(re.fullmatch(pattern, m) for m in used), f"{topic} is exported: no panel"
