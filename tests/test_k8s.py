"""KubeRay manifests: catalog values, naming rules, and the real KubeRay CRD schemas.

Pure and fast: no Ray cluster, no Kubernetes. The CRDs are the ones shipped in
the package (``rayslice/kuberay_crds``) unless ``$RAYSLICE_KUBERAY_CRDS`` says
otherwise; a missing CRD directory fails, never skips.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayslice import k8s
from rayslice.k8s import ClusterSpec, ManifestError
from rayslice.topology import GENERATIONS, Topology, valid_topologies

IMAGE = "us-docker.pkg.dev/proj/repo/rayslice:0.1.0"
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
IANA_SVC_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # container port names

# (accelerator spelling, topology, chips_per_host)
SHAPES = [
    ("v6e", "2x2", None),
    ("TPU-V6E", "2x4", None),
    ("v6e", "2x4", 4),
    ("tpu-v6e-slice", "4x4", None),
    ("trillium", "8x8", None),
    ("v5e", "4x8", None),
    ("TPU-V5LITEPOD", "2x2", None),
    ("v4", "2x2x2", None),
    ("TPU-V4", "4x4x4", None),
    ("v5p", "2x2x4", None),
    ("v7x", "2x2x2", None),
    ("ironwood", "4x4x4", None),
]
# Plus the smallest and largest shape of EVERY generation in the catalog, so a
# new generation is covered without editing this file.
SHAPES += [(g, s, None) for g in GENERATIONS for s in {valid_topologies(g)[0], valid_topologies(g)[-1]}]
# Several slices (GKE Multislice) only for multi-host shapes; single-host ones are refused below.
CASES = [
    pytest.param(a, t, c, n, id=f"{a}-{t}-{c or 'default'}x{n}")
    for a, t, c in SHAPES
    for n in ((1, 3) if Topology.parse(a, t, chips_per_host=c).num_hosts > 1 else (1,))
]
SAMPLE_ENV = {  # KubeRay ray-cluster.tpu-v6e-16-multihost.yaml, GKE ray-job.tpu-v6e-multihost.yaml
    "NODE_IP": {"valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
    "VBAR_CONTROL_SERVICE_URL": {"value": "$(NODE_IP):8353"},
    "JAX_PLATFORMS": {"value": "tpu,cpu"},
    "ENABLE_PJRT_COMPATIBILITY": {"value": "true"},
}


def make(accelerator="v6e", topology="4x4", chips_per_host=None, num_slices=1, **kw) -> ClusterSpec:
    kw.setdefault("entrypoint", "python -m my_pkg.train")
    return ClusterSpec(accelerator, topology, chips_per_host=chips_per_host, num_slices=num_slices, image=IMAGE, **kw)


def cluster_body(doc: dict) -> dict:
    return {
        "RayCluster": lambda d: d["spec"],
        "RayJob": lambda d: d["spec"]["rayClusterSpec"],
        "RayService": lambda d: d["spec"]["rayClusterConfig"],
    }[doc["kind"]](doc)


@pytest.fixture(scope="module")
def crd_dir():
    return k8s.find_crd_dir()  # raises (test error) if the CRDs are missing


@pytest.fixture
def no_crd_env(monkeypatch):
    monkeypatch.delenv(k8s.CRD_DIR_ENV, raising=False)


def test_shapes_cover_every_generation():
    assert {Topology.parse(a, t).generation for a, t, _ in SHAPES} == set(GENERATIONS)


@pytest.mark.parametrize("accelerator, topology, chips, num_slices", CASES)
@pytest.mark.parametrize("kind", k8s.KINDS)
def test_manifest_matches_catalog_and_crd(kind, accelerator, topology, chips, num_slices, crd_dir):
    spec = make(accelerator, topology, chips, num_slices)
    t = Topology.parse(accelerator, topology, chips_per_host=chips)
    doc = k8s.manifest(kind, spec)
    k8s.validate(doc, crd_dir)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"].lower() == kind

    body = cluster_body(doc)
    assert body["rayVersion"] == "2.60.0"
    head = body["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head
    assert all(
        "google.com/tpu" not in c["resources"].get(part, {})
        for c in head["containers"]
        for part in ("requests", "limits")
    )
    (group,) = body["workerGroupSpecs"]
    assert group["numOfHosts"] == t.num_hosts
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == num_slices
    assert "enableInTreeAutoscaling" not in body
    assert group["groupName"] == f"tpu-{t.generation}-{t.name}"
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["requests"]["google.com/tpu"] == str(t.chips_per_host)
    assert worker["resources"]["limits"] == worker["resources"]["requests"]
    selector = group["template"]["spec"]["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] == t.gke_accelerator
    assert selector["cloud.google.com/gke-tpu-topology"] == t.name
    assert selector.get("node.kubernetes.io/instance-type", t.gke_machine_type) == t.gke_machine_type
    assert group["rayStartParams"] == {}  # KubeRay maps google.com/tpu to Ray's TPU resource itself

    env = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in worker.get("env", [])}
    if t.generation in ("v6e", "v7x") and t.num_hosts > 1:
        assert env == SAMPLE_ENV
        assert [e["name"] for e in worker["env"]].index("NODE_IP") == 0  # $(NODE_IP) needs it defined first
    else:
        assert env == {}
    assert all("env" not in c for c in head["containers"])

    worker_ports = {p["containerPort"]: p["name"] for p in worker.get("ports", [])}
    assert (worker_ports == {8081: "mxla"}) if num_slices > 1 else (worker_ports == {})
    head_ports = {p["containerPort"]: p["name"] for c in head["containers"] for p in c.get("ports", [])}
    assert {6379: "gcs", 8265: "dashboard", 10001: "client"}.items() <= head_ports.items()
    assert (head_ports.get(8000) == "serve") == (kind != "rayjob")
    assert 8081 not in head_ports

    names = [doc["metadata"]["name"], group["groupName"]]
    names += [c["name"] for g in (head, group["template"]["spec"]) for c in g["containers"]]
    for name in names:
        assert DNS1123_LABEL.fullmatch(name) and len(name) <= 63, name
    for name in list(head_ports.values()) + list(worker_ports.values()):
        assert IANA_SVC_NAME.fullmatch(name) and len(name) <= 15, name


@pytest.mark.parametrize("kind", k8s.KINDS)
def test_yaml_round_trip_validates(kind, crd_dir):
    doc = k8s.manifest(kind, make(num_slices=2, namespace="ml-team", name="llama-train"))
    text = k8s.to_yaml(doc)
    assert text.startswith("apiVersion: ray.io/v1\nkind: ")
    loaded = yaml.safe_load(text)
    assert loaded == doc
    k8s.validate(loaded, crd_dir)
    assert loaded["metadata"]["namespace"] == "ml-team"


def test_autoscaling_scales_whole_slices_from_zero(crd_dir):
    doc = k8s.raycluster(make("v5p", "2x2x4", num_slices=4, enable_autoscaling=True))
    k8s.validate(doc, crd_dir)
    assert doc["spec"]["enableInTreeAutoscaling"] is True
    group = doc["spec"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == (0, 0, 4, 4)


def test_rayjob_fields(crd_dir):
    doc = k8s.rayjob(make(entrypoint="python -m rayslice.demo --steps 10"))
    assert doc["spec"]["entrypoint"] == "python -m rayslice.demo --steps 10"
    assert doc["spec"]["shutdownAfterJobFinishes"] is True
    cluster = k8s.raycluster(make())["spec"]
    assert doc["spec"]["rayClusterSpec"]["workerGroupSpecs"] == cluster["workerGroupSpecs"]


def test_two_host_v6e_2x4_never_lands_on_an_8_chip_vm():
    def sel(spec):
        return k8s.raycluster(spec)["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]

    assert sel(make("v6e", "2x4", 4))["node.kubernetes.io/instance-type"] == "ct6e-standard-4t"
    assert sel(make("v6e", "2x4"))["node.kubernetes.io/instance-type"] == "ct6e-standard-8t"
    assert "node.kubernetes.io/instance-type" not in sel(make("v6e", "4x4"))


def test_serve_config_is_a_valid_serve_config_for_the_builder():
    from ray.serve.schema import ServeDeploySchema

    from rayslice.serve.deployment import SliceServeConfig

    doc = k8s.rayservice(make("v4", "2x2x2", num_slices=3, name="regressor"))
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "rayslice.serve.builder:app"
    args = app["args"]
    assert args["model"] == k8s.MODEL_PLACEHOLDER and args["num_replicas"] == 3
    cfg = SliceServeConfig.from_accelerator_config(args["accelerator_type"], args["accelerator_config"])
    assert (cfg.topology_info.accelerator_type, cfg.topology_info.name) == ("TPU-V4", "2x2x2")

    custom = k8s.rayservice(make(service_import_path="my_pkg.app:deployment"))
    (app,) = yaml.safe_load(custom["spec"]["serveConfigV2"])["applications"]
    assert app == {"name": "rayslice", "route_prefix": "/", "import_path": "my_pkg.app:deployment"}


@pytest.mark.parametrize(
    "kwargs, value",
    [
        (dict(topology="3x3"), "3x3"),
        (dict(topology="2x2x2"), "2x2x2"),  # v6e takes 2D shapes
        (dict(accelerator="v9z"), "v9z"),
        (dict(accelerator="TPU-V3"), "TPU-V3"),
        (dict(chips_per_host=2), "chips_per_host=2"),
        (dict(image=""), "image=''"),
        (dict(image="   "), "image='   '"),
        (dict(image=None), "image=None"),
        (dict(name="MyJob"), "name='MyJob'"),
        (dict(name="my_job"), "name='my_job'"),
        (dict(name="a" * 64), "a" * 64),
        (dict(name="a" * 48), "a" * 48),  # KubeRay appends 6 chars to RayJob names
        (dict(name="1job"), "name='1job'"),
        (dict(name="job-"), "name='job-'"),
        (dict(name=""), "name=''"),
        (dict(num_slices=0), "num_slices=0"),
        (dict(num_slices=True), "num_slices=True"),
        (dict(namespace="Team_A"), "namespace='Team_A'"),
        (dict(worker_memory="32 GB"), "worker_memory='32 GB'"),
        (dict(head_cpu=4), "head_cpu=4"),
        (dict(ray_version="latest"), "ray_version='latest'"),
        (dict(entrypoint=""), "entrypoint=''"),
        (dict(service_import_path="not a path"), "service_import_path='not a path'"),
        (dict(topology="2x2", num_slices=2), "num_slices=2"),  # single-host: no Multislice
        (dict(ray_version="2.60"), "ray_version='2.60'"),
    ],
)
def test_invalid_requests_name_the_value(kwargs, value):
    args = dict(accelerator="v6e", topology="4x4", image=IMAGE) | kwargs
    with pytest.raises(ValueError) as err:
        ClusterSpec(args.pop("accelerator"), args.pop("topology"), **args)
    assert value in str(err.value)
    assert re.search(r"valid|supports", str(err.value))  # says what would be accepted


def test_name_rules_are_explained():
    with pytest.raises(ValueError) as err:
        make(name="Bad_Name")
    assert "DNS-1035" in str(err.value) and "47" in str(err.value)
    assert make(name="a" * 47).name == "a" * 47


def test_rayjob_without_entrypoint():
    spec = make(entrypoint=None)
    k8s.raycluster(spec)
    k8s.rayservice(spec)
    with pytest.raises(ValueError, match="entrypoint=None"):
        k8s.rayjob(spec)
    with pytest.raises(ValueError, match="entrypoint=None"):
        k8s.manifest("rayjob", spec)


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"kind='deployment'.*raycluster, rayjob, rayservice"):
        k8s.manifest("deployment", make())


def _broken(mutate):
    doc = k8s.raycluster(make(num_slices=2))
    mutate(doc)
    return doc


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda d: d["spec"]["workerGroupSpecs"][0].update(numOfHosts="4"), "workerGroupSpecs[0].numOfHosts"),
        (lambda d: d["spec"].pop("headGroupSpec"), "'headGroupSpec' is a required property"),
        (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required property"),
        (lambda d: d["spec"]["workerGroupSpecs"][0].update(numOfHost=4), "'numOfHost' was unexpected"),
        (
            lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
                "limits"
            ].update({"google.com/tpu": "four"}),
            "limits.google.com/tpu",
        ),
        (lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas=2**31), "is not a 'int32'"),
        (
            lambda d: d["spec"]["workerGroupSpecs"][0]["rayStartParams"].update(resources={"TPU": 4}),
            "rayStartParams.resources",
        ),
        (
            lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["ports"][0].pop(
                "containerPort"
            ),
            "'containerPort' is a required property",
        ),
    ],
)
def test_broken_manifest_fails_validation(mutate, where, crd_dir):
    doc = _broken(mutate)
    with pytest.raises(ManifestError) as err:
        k8s.validate(doc, crd_dir)
    assert where in str(err.value)
    assert err.value.errors


def test_validate_rejects_non_kuberay_documents():
    with pytest.raises(ManifestError, match="not a KubeRay ray.io/v1 manifest"):
        k8s.validate({"apiVersion": "v1", "kind": "Pod"})
    doc = k8s.raycluster(make())
    with pytest.raises(ManifestError, match="ray.io/v1alpha1"):
        k8s.validate(dict(doc, apiVersion="ray.io/v1alpha1"))


def test_bundled_crds_are_package_data_with_their_provenance(no_crd_env):
    crds = k8s.find_crd_dir()
    package = Path(k8s.__file__).parent
    assert Path(str(crds)).resolve() == (package / "kuberay_crds").resolve()  # inside the package, not ../
    readme = (package / "kuberay_crds" / "README.md").read_text()
    assert "ray-project/kuberay" in readme and re.search(r"commit\s+`[0-9a-f]{40}`", readme)
    license_text = (package / "kuberay_crds" / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    # Unmodified: each file's sha256 is the one the README records.
    for kind, name in k8s._CRD_FILE.items():
        digest = hashlib.sha256(crds.joinpath(name).read_bytes()).hexdigest()
        assert f"| `{name}` | `{digest}` |" in readme, name
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 1-MB files in a fraction of a second
        assert yaml.load(crds.joinpath(name).read_text(), Loader=loader)["spec"]["names"]["kind"] == kind
    k8s.validate(k8s.raycluster(make()))


def test_crd_env_overrides_and_a_bad_path_is_an_error(monkeypatch, tmp_path, crd_dir):
    own = tmp_path / "crds"
    own.mkdir()
    for name in k8s._CRD_FILE.values():
        (own / name).write_bytes(crd_dir.joinpath(name).read_bytes())
    monkeypatch.setenv(k8s.CRD_DIR_ENV, str(own))
    assert k8s.find_crd_dir() == own
    k8s.validate(k8s.raycluster(make()))

    monkeypatch.setenv(k8s.CRD_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(k8s.CRDNotFoundError, match="nowhere.*is not a directory"):
        k8s.find_crd_dir()
    with pytest.raises(FileNotFoundError, match=k8s.CRD_DIR_ENV):  # never falls back to the bundled CRDs
        k8s.validate(k8s.raycluster(make()))

    (own / "ray.io_rayjobs.yaml").unlink()
    monkeypatch.setenv(k8s.CRD_DIR_ENV, str(own))
    with pytest.raises(k8s.CRDNotFoundError, match="ray.io_rayjobs.yaml missing"):
        k8s.find_crd_dir()
    with pytest.raises(FileNotFoundError, match="ray.io_rayjobs.yaml"):
        k8s.validate(k8s.rayjob(make()), tmp_path)

    monkeypatch.setenv(k8s.CRD_DIR_ENV, "")  # set but empty: as if unset
    assert Path(str(k8s.find_crd_dir())).name == "kuberay_crds"


def test_validate_does_not_change_the_document(crd_dir):
    doc = k8s.rayservice(make(num_slices=3))
    before = copy.deepcopy(doc)
    k8s.validate(doc, crd_dir)
    assert doc == before


def test_single_host_shapes_refuse_several_slices():
    for accelerator, topology, hint in [
        ("v6e", "2x2", "4x4"),
        ("v5e", "1x1", "4x4"),
        ("v4", "2x2x1", "2x2x2"),
        ("v6e", "2x4", "chips_per_host=4"),
    ]:
        with pytest.raises(ValueError, match="Multislice") as err:
            make(accelerator, topology, num_slices=2)
        assert "num_slices=2" in str(err.value) and hint in str(err.value)
        with pytest.raises(ValueError, match="single-host"):
            make(accelerator, topology, num_slices=4, enable_autoscaling=True)
        assert make(accelerator, topology).num_slices == 1
    doc = k8s.raycluster(make("v6e", "2x4", chips_per_host=4, num_slices=2))  # two 4-chip hosts: multi-host
    assert doc["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 2


@pytest.mark.parametrize(
    "image, ray_version, expected",
    [
        ("rayproject/ray:2.60.0-py311-cpu", None, "2.60.0"),
        ("rayproject/ray:2.52.1", None, "2.52.1"),
        ("docker.io/rayproject/ray-ml:2.9.3-py310-gpu", None, "2.9.3"),
        ("rayproject/ray:2.44.0@sha256:" + "0" * 64, None, "2.44.0"),
        ("rayproject/ray:nightly-py311", None, "2.60.0"),
        ("us-docker.pkg.dev/p/r/rayslice:0.1.0", None, "2.60.0"),
        ("myorg/rayproject-ray:2.10.0", None, "2.60.0"),
        ("us-docker.pkg.dev/p/r/rayslice:0.1.0", "2.58.0", "2.58.0"),
        ("rayproject/ray:2.52.1", "2.60.0", "2.60.0"),  # explicit wins
    ],
)
def test_ray_version_from_option_image_or_pin(image, ray_version, expected, crd_dir):
    spec = ClusterSpec("v6e", "4x4", image=image, ray_version=ray_version)
    assert spec.ray_version == expected
    for kind in k8s.KINDS:
        doc = k8s.manifest(kind, ClusterSpec("v6e", "4x4", image=image, ray_version=ray_version, entrypoint="x"))
        k8s.validate(doc, crd_dir)
        assert cluster_body(doc)["rayVersion"] == expected


def test_pinned_ray_version_is_the_installed_ray():
    assert importlib.metadata.version("ray") == k8s.PINNED_RAY_VERSION


def test_manifest_code_does_not_import_the_runtime():
    # k8s is pure manifest code: it imports TPU facts from topology, never gang/placement, Ray or JAX.
    import ast

    tree = ast.parse(Path(k8s.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    ours = {m for m in imported if m.startswith("rayslice")}
    assert ours <= {"rayslice.topology", "rayslice._validate", "rayslice.errors"}, ours
    assert not {m for m in imported if m.split(".")[0] in ("ray", "jax")}


RAYSLICE = [sys.executable, "-m", "rayslice.cli"]


def cli(*args, env=None):
    return subprocess.run(
        [*RAYSLICE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_cli_k8s_validates_with_the_bundled_crds(tmp_path):
    env = {k8s.CRD_DIR_ENV: ""}
    out = cli(
        "k8s",
        "rayjob",
        "--accelerator",
        "v6e",
        "--topology",
        "4x4",
        "--slices",
        "2",
        "--image",
        "rayproject/ray:2.59.0-py311",
        "--entrypoint",
        "python -m job",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no note, no warning
    doc = yaml.safe_load(out.stdout)
    k8s.validate(doc)
    body = doc["spec"]["rayClusterSpec"]
    assert body["rayVersion"] == "2.59.0"
    assert {e["name"] for e in body["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]} == set(
        SAMPLE_ENV
    )
    out = cli(
        "k8s",
        "raycluster",
        "--accelerator",
        "v4",
        "--topology",
        "2x2x2",
        "--image",
        "img:1",
        "--ray-version",
        "2.58.1",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["spec"]["rayVersion"] == "2.58.1"


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ("--accelerator", "v6e", "--topology", "2x2", "--slices", "2"),
            {},
            "error: num_slices=2 is not valid: expected 1 for v6e 2x2, a single-host slice (GKE Multislice",
        ),
        (
            ("--accelerator", "v6e", "--topology", "4x4"),
            {k8s.CRD_DIR_ENV: "/nonexistent/crds"},
            "error: $RAYSLICE_KUBERAY_CRDS='/nonexistent/crds' is not a directory",
        ),
        (
            ("--accelerator", "v6e", "--topology", "4x4", "--ray-version", "latest"),
            {},
            "error: ray_version='latest' is not valid",
        ),
    ],
)
def test_cli_k8s_errors_are_one_line(args, env, message):
    out = cli("k8s", "raycluster", "--image", "img:1", *args, env=env)
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr
