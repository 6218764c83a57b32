"""The KubeRay manifests, offline: every rendered overlay validated against the KubeRay CRDs' openAPIV3Schema made
strict (unknown fields rejected, as kubectl's strict validation does), every serveConfigV2 against Ray Serve's own
schema (plus the keys it would silently ignore) and our `build_app` args, every entrypoint parsed by the job's own
argument parser, and every file, image and secret a manifest names accounted for. The Dockerfile installs exactly
as the README does."""

from __future__ import annotations

import copy
import importlib
import re
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "kuberay-crds"
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())
APP = "/app"  # where the Dockerfile puts the repository


def render(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed: cannot render k8s/ overlays")
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "k8s" / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def strict(schema: dict) -> dict:
    """The CRD schema as strict JSON Schema: int-or-string spelled out, no unknown fields where properties are
    listed (unless the CRD preserves unknown fields there)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.pop("x-kubernetes-int-or-string", False):
                node["anyOf"] = [{"type": "string"}, {"type": "integer"}]
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for v in list(node.values()):
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


@lru_cache(maxsize=None)
def validator(kind: str):
    jsonschema = pytest.importorskip("jsonschema")
    if not CRDS.is_dir():
        pytest.skip(f"{CRDS} is absent (the shared folder beside the repository): cannot validate against the CRDs")
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def ray_objects(overlay: str) -> list[dict]:
    docs = render(overlay)
    assert {d["kind"] for d in docs} >= {"RayCluster", "RayJob", "RayService"}, overlay
    return [d for d in docs if d["apiVersion"] == "ray.io/v1"]


def cluster_spec(doc: dict) -> dict:
    return {"RayCluster": lambda: doc["spec"], "RayJob": lambda: doc["spec"]["rayClusterSpec"],
            "RayService": lambda: doc["spec"]["rayClusterConfig"]}[doc["kind"]]()


def containers(doc: dict) -> list[dict]:
    spec = cluster_spec(doc)
    groups = [spec["headGroupSpec"]] + spec.get("workerGroupSpecs", [])
    out = [c for g in groups for c in g["template"]["spec"]["containers"]]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        out += doc["spec"]["submitterPodTemplate"]["spec"]["containers"]
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid_against_the_strict_crd_schema(overlay):
    for doc in ray_objects(overlay):
        errors = sorted(validator(doc["kind"]).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{overlay} {doc['kind']} {doc['metadata']['name']}: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5])


def test_the_strict_schema_rejects_typos_and_wrong_types():
    job = next(d for d in ray_objects("gpu") if d["kind"] == "RayJob")
    typo = copy.deepcopy(job)
    typo["spec"]["shutdownAfterJobFinish"] = typo["spec"].pop("shutdownAfterJobFinishes")
    assert any("Additional properties" in e.message for e in validator("RayJob").iter_errors(typo))
    wrong = copy.deepcopy(job)
    wrong["spec"]["shutdownAfterJobFinishes"] = "yes"
    assert any("is not of type 'boolean'" in e.message for e in validator("RayJob").iter_errors(wrong))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clusters_run_token_auth_our_image_sized_pods_and_no_inline_secrets(overlay):
    for doc in ray_objects(overlay):
        assert cluster_spec(doc)["authOptions"] == {"mode": "token"}, doc["metadata"]["name"]
        if doc["kind"] == "RayCluster":
            assert cluster_spec(doc)["enableInTreeAutoscaling"] is True
        if cluster_spec(doc).get("enableInTreeAutoscaling"):  # the autoscaler sidecar is sized too
            res = cluster_spec(doc)["autoscalerOptions"]["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
        for c in containers(doc):
            assert re.fullmatch(r"registry\.example\.com/mmspec-ray:0\.1\.0-(cpu|cuda)", c["image"]), c["image"]
            res = c.get("resources", {})  # requests and limits on every container
            assert {"cpu", "memory"} <= set(res.get("requests", {})) and {"cpu", "memory"} <= set(
                res.get("limits", {})), (doc["metadata"]["name"], c["name"])
            for env in c.get("env", []):
                assert "value" not in env or not re.search(r"(?i)secret|token|key", env["name"]), env
            refs = [e["secretRef"]["name"] for e in c.get("envFrom", [])]
            assert set(refs) <= {"mmspec-s3"}
        if doc["kind"] == "RayJob":
            assert doc["spec"]["shutdownAfterJobFinishes"] is True and doc["spec"]["ttlSecondsAfterFinished"] > 0
    text = "".join(p.read_text() for p in (ROOT / "k8s").rglob("*.yaml"))
    assert not re.search(r"AWS_SECRET_ACCESS_KEY\s*:\s*\S|aws_secret_access_key\s*=", text), "credentials inline"


def test_gpu_overlay_requests_gpus_and_toy_overlay_none():
    for doc in ray_objects("gpu"):
        spec = cluster_spec(doc)
        for g in spec["workerGroupSpecs"]:
            res = g["template"]["spec"]["containers"][0]["resources"]
            assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "1"
            assert g["rayStartParams"]["num-gpus"] == "1"
        for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:  # the driver reads the checkpoint too
            mounts = g["template"]["spec"]["containers"][0]["volumeMounts"]
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in mounts
    toy = yaml.safe_dump(ray_objects("toy-cpu"))
    assert "nvidia.com/gpu" not in toy and "--gpus-per-actor" not in toy


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_entrypoints_name_real_scripts_with_flags_the_job_accepts(overlay):
    from mmspec_ray.batch.cli import JOBS, build_parser
    from mmspec_ray.training.cli import build_parser as train_parser

    jobs = [d for d in ray_objects(overlay) if d["kind"] == "RayJob"]
    assert {Path(shlex.split(d["spec"]["entrypoint"])[1]).stem for d in jobs} == set(JOBS) | {"train_drafter"}
    for doc in jobs:
        argv = shlex.split(doc["spec"]["entrypoint"])
        assert argv[0] == "python" and argv[1].startswith(f"{APP}/"), argv[:2]
        script = ROOT / argv[1][len(APP) + 1:]
        assert script.is_file(), f"{doc['metadata']['name']} runs {argv[1]}, which is not in the repo"
        parser = train_parser() if script.stem == "train_drafter" else build_parser(script.stem)
        parser.parse_args(argv[2:])  # a typo in a flag exits here (SystemExit)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_is_valid_for_ray_serve_and_our_builder(overlay):
    from ray.serve.schema import ServeDeploySchema
    from serve_fixtures import unknown_serve_keys

    from mmspec_ray.serve.app import DEPLOYMENT_NAME
    from mmspec_ray.serve.settings import ServeSettings

    services = [d for d in ray_objects(overlay) if d["kind"] == "RayService"]
    assert services
    for doc in services:
        data = yaml.safe_load(doc["spec"]["serveConfigV2"])
        config = ServeDeploySchema.model_validate(data)
        unknown = unknown_serve_keys(ServeDeploySchema, data)  # keys Serve's schema would silently ignore
        assert not unknown, f"{overlay} serveConfigV2: unknown keys {unknown}"
        for app in config.applications:
            module, attr = app.import_path.split(":")
            assert callable(getattr(importlib.import_module(module), attr)), app.import_path
            settings = ServeSettings.model_validate(app.args)
            assert [d.name for d in app.deployments] == [DEPLOYMENT_NAME], app.name
            if settings.api_key_env:  # replicas may land on any Ray pod: each needs the key, from a secret
                for c in containers(doc):
                    assert any(e["name"] == settings.api_key_env and "secretKeyRef" in e.get("valueFrom", {})
                               for e in c.get("env", [])), c["name"]
        for c in containers(doc):  # every pod's HTTP proxy answers its own errors in the API's format
            from mmspec_ray.serve.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

            assert {"name": PROXY_CALLBACK_ENV, "value": PROXY_CALLBACK} in c.get("env", []), c["name"]


def test_dockerfile_installs_the_readme_way():
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"```bash\n(bash scripts/bootstrap\.sh)[^\n]*\n```", readme)
    assert setup, "README's set-up command starts with bash scripts/bootstrap.sh"
    runs = [" ".join(m.split()) for m in re.findall(r"^RUN (.+?)(?<!\\)$", (ROOT / "Dockerfile").read_text(),
                                                    re.M | re.S)]
    installs = [r for r in runs if "apt-get" not in r]
    assert len(installs) == 1 and installs[0].endswith(setup.group(1)), runs
    assert "pip install" not in (ROOT / "Dockerfile").read_text(), "a second way to install"
    copied = re.findall(r"^COPY (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    for src in copied:
        assert (ROOT / src).exists(), src
    assert "TORCH_INDEX_URL" in readme and "TORCH_INDEX_URL" in (ROOT / "scripts" / "bootstrap.sh").read_text()
