"""The Helm chart (build/helm/dspark, docs/architecture.md §11), rendered by a real Helm engine
(Helm's Go SDK through helm-python-sdk's libhelm_c, no cluster) for both profiles, every
rendered Kubernetes object validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields fail) and the ServiceMonitor, a custom resource
kubernetes-validate has no schema for, against the fields of its CRD that the chart uses."""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from dspark import wiring
from dspark.paths import REPO_ROOT

CHART = REPO_ROOT / "build" / "helm" / "dspark"
PROFILES = {"cpu": CHART / "values-cpu.yaml", "gpu": CHART / "values-gpu-trtllm.yaml"}
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler"}

DURATION = "^(0|(([0-9]+)(ms|s|m|h))+)$"  # the CRD's pattern for scrape intervals
# monitoring.coreos.com/v1 ServiceMonitor: the fields this chart sets, as the CRD types them.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": DURATION},
                        },
                    },
                },
            },
        },
    },
}


def render(values: dict | None, release: str = "dspark") -> dict[str, dict]:
    """{kind: object} of the chart rendered with `values` (helm template, offline)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=release, namespace="inference")
    objects = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in objects, f"two {doc['kind']} objects"
                objects[doc["kind"]] = doc
    return objects


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request) -> tuple[str, dict[str, dict]]:
    return request.param, render(yaml.safe_load(PROFILES[request.param].read_text()))


def container(objects: dict, name: str = "triton") -> dict:
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def test_helm_lint_is_clean():
    for values_file in PROFILES.values():
        report = helm.lint(CHART, yaml.safe_load(values_file.read_text()), strict=True)
        errors = [m for m in report["messages"] if m["severity"] >= 2 and "icon" not in m["error"]]
        assert not report["errors"] and not errors, report


def test_every_object_validates_against_kubernetes_schemas(profile):
    _, objects = profile
    assert set(objects) == CORE_KINDS | {"ServiceMonitor"}
    for kind in CORE_KINDS:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(objects[kind], version, strict=True)
    jsonschema.validate(objects["ServiceMonitor"], SERVICE_MONITOR_SCHEMA)


def test_validation_bites():
    """The validators reject what is wrong, so passing them means something."""
    objects = render(None)
    bad = copy.deepcopy(objects["Deployment"])
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)
    bad = copy.deepcopy(objects["ServiceMonitor"])
    bad["spec"]["endpoints"][0]["interval"] = "ten seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SERVICE_MONITOR_SCHEMA)


def test_probes_ports_and_security(profile):
    _, objects = profile
    c = container(objects)
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == PORTS
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= mounts  # the writable places on a read-only root
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]


def test_service_monitor_and_hpa_target_the_deployment(profile):
    _, objects = profile
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = objects["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    assert {p["name"]: p["port"] for p in service["ports"]} == PORTS
    monitor = objects["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= objects["Service"]["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] == "metrics" and monitor["endpoints"][0]["path"] == "/metrics"
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    adapter = yaml.safe_load((REPO_ROOT / "build" / "helm" / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert hpa["metrics"][0]["pods"]["metric"]["name"] in served
    assert "replicas" not in objects["Deployment"]["spec"]  # the HPA owns the replica count


def test_engine_settings_become_the_wiring_env_vars(profile):
    name, objects = profile
    env = {e["name"]: e["value"] for e in container(objects)["env"]}
    settings = {k: v for k, v in env.items() if k.startswith("DSPARK_") and k != "DSPARK_MODELS"}
    assert set(settings) <= set(wiring.ENV_VARS.values()), set(settings) - set(wiring.ENV_VARS.values())
    assert {"DSPARK_MODEL", "DSPARK_DRAFTER", "DSPARK_POLICY", "DSPARK_GAMMA"} <= set(settings)
    values = yaml.safe_load(PROFILES[name].read_text())
    assert settings["DSPARK_POLICY"] == values["dspark"]["policy"]
    assert settings["DSPARK_GAMMA"] == str(values["dspark"]["gamma"])
    assert env["DSPARK_MODELS"] == "/models"
    # every setting parses the way the server will parse it
    spec = wiring.resolve(env={k: v for k, v in settings.items()})
    assert spec.gamma == values["dspark"]["gamma"] and spec.policy == values["dspark"]["policy"]


def test_cpu_profile_fetches_the_default_model():
    objects = render(yaml.safe_load(PROFILES["cpu"].read_text()))
    init = container(objects, "fetch-model")
    assert init["command"] == ["dspark", "fetch-model"]
    assert {"name": "DSPARK_MODELS", "value": "/models"} in init["env"]
    assert "nvidia.com/gpu" not in container(objects)["resources"].get("limits", {})
    env = {e["name"]: e["value"] for e in container(objects)["env"]}
    assert env["DSPARK_MODEL"] == "smollm2" and env["DSPARK_DEVICE"] == "cpu"


def test_gpu_profile_requests_a_gpu_and_mounts_prepared_engines():
    objects = render(yaml.safe_load(PROFILES["gpu"].read_text()))
    c = container(objects)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["command"][0] == "tritonserver"
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["dspark-trtllm-models"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_values_override_like_helm_set():
    values = helm.parse_set_string(
        "dspark.policy=fixed:7,dspark.gamma=15,autoscaling.enabled=false,replicaCount=3"
    )
    objects = render(values)
    env = {e["name"]: e["value"] for e in container(objects)["env"]}
    assert env["DSPARK_POLICY"] == "fixed:7" and env["DSPARK_GAMMA"] == "15"
    assert "HorizontalPodAutoscaler" not in objects and objects["Deployment"]["spec"]["replicas"] == 3


def test_chart_files_exist():
    for name in ("Chart.yaml", "values.yaml", "values-cpu.yaml", "values-gpu-trtllm.yaml"):
        assert (CHART / name).is_file()
    assert Path(CHART / "templates" / "NOTES.txt").is_file()
