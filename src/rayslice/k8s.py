"""KubeRay manifests (RayCluster, RayJob, RayService) for whole TPU slices on GKE.

Every TPU fact (hosts per slice, chips per host, GKE labels) comes from
:mod:`rayslice.topology`. The layout follows GKE's and KubeRay's TPU samples
(KubeRay ``ray-cluster.tpu-v6e-16-multihost.yaml``, GKE
``ai-ml/gke-ray/tpu/ray-job.tpu-v6e-multihost.yaml``): a CPU-only head and ONE
TPU worker group whose replicas are slices, ``numOfHosts`` pods per replica,
``google.com/tpu`` requests and limits equal to the chips of one host, and the
``cloud.google.com/gke-tpu-accelerator`` / ``gke-tpu-topology`` node selectors.
``rayStartParams`` stays empty: KubeRay turns the ``google.com/tpu`` limit into
Ray's ``TPU`` resource itself, and Ray detects the TPU type and slice on GKE.
Multi-slice groups open port 8081 (``mxla``), the ``MEGASCALE_PORT`` that
:mod:`rayslice.gang` gives libtpu.

:func:`validate` checks a manifest against the KubeRay CRD's v1 OpenAPI schema
as strictly as ``kubectl apply`` does: unknown fields are errors.

>>> spec = ClusterSpec("TPU-V6E", "4x4", num_slices=2, image="rayproject/ray:2.60.0")
>>> group = raycluster(spec)["spec"]["workerGroupSpecs"][0]
>>> group["groupName"], group["numOfHosts"], group["replicas"]
('tpu-v6e-4x4', 4, 2)
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayslice.gang import MEGASCALE_PORT
from rayslice.topology import Topology, chips_per_host_options

__all__ = ["CRD_DIR_ENV", "KINDS", "ClusterSpec", "ManifestError", "find_crd_dir", "manifest",
           "raycluster", "rayjob", "rayservice", "to_yaml", "validate"]

API_VERSION = "ray.io/v1"
CRD_DIR_ENV = "RAYSLICE_KUBERAY_CRDS"
KINDS: tuple[str, ...] = ("raycluster", "rayjob", "rayservice")
_CRD_FILE = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayService": "ray.io_rayservices.yaml"}
DEFAULT_IMPORT_PATH = "rayslice.serve.builder:app"
MODEL_PLACEHOLDER = "CHANGE_ME.module:ModelClass"
SERVE_PORT = 8000

# KubeRay (ray-operator/controllers/ray/utils/validation.go) wants DNS-1035
# labels (a DNS-1123 label that starts with a letter) of at most 53 characters
# for a RayCluster, 47 for a RayJob or RayService (it appends 6 characters to
# name their cluster). One spec makes all three kinds, so 47 is the limit.
_MAX_NAME = 47
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Kubernetes resource quantity, as in the CRD's int-or-string pattern (no sign).
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?(\d+(\.\d*)?|\.\d+))?")
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class ManifestError(ValueError):
    """A manifest does not match its KubeRay CRD; ``errors`` lists every problem."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


def _fail(what: str, value: object, valid: str) -> ValueError:
    return ValueError(f"{what}={value!r} is not valid; valid: {valid}")


@dataclass(frozen=True)
class ClusterSpec:
    """What to run: a TPU slice shape, how many slices, and the pods around them.

    Validated on construction: a bad value raises ValueError naming it and
    saying what is valid. ``accelerator`` takes any spelling the catalog knows
    ("v6e", "TPU-V6E", "tpu-v6e-slice", "trillium"). ``name`` must be a DNS-1035
    label of at most 47 characters (KubeRay's rule for RayJob/RayService names).
    ``worker_cpu``/``worker_memory`` default to what fits every TPU host type,
    the smallest being ct5lp-hightpu-1t (24 vCPUs, 48 GB). With
    ``enable_autoscaling`` the group starts at 0 slices and the Ray autoscaler
    adds whole slices, up to ``num_slices``.

    >>> ClusterSpec("v4", "2x2x2", image="img:1").slice.num_hosts
    2
    >>> ClusterSpec("v4", "2x2x2", image="img:1", name="My_Job")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: name='My_Job' is not valid; valid: ...
    """

    accelerator: str
    topology: str
    _: KW_ONLY
    image: str
    num_slices: int = 1
    name: str = "rayslice"
    chips_per_host: int | None = None
    ray_version: str = "2.60.0"
    head_cpu: str = "4"
    head_memory: str = "16Gi"
    worker_cpu: str = "8"
    worker_memory: str = "32Gi"
    entrypoint: str | None = None
    enable_autoscaling: bool = False
    service_import_path: str | None = None
    namespace: str | None = None
    slice: Topology = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slice", Topology.parse(
            self.accelerator, self.topology, chips_per_host=self.chips_per_host))
        if not isinstance(self.image, str) or not self.image.strip() or re.search(r"\s", self.image):
            raise _fail("image", self.image, "a non-empty container image reference without spaces, "
                        "e.g. 'rayproject/ray:2.60.0-py311' (with rayslice and jax[tpu] installed)")
        if type(self.num_slices) is not int or not 1 <= self.num_slices <= 2**31 - 1:
            raise _fail("num_slices", self.num_slices, "an int >= 1")
        name = self.name
        if not isinstance(name, str) or not _DNS1035.fullmatch(name) or len(name) > _MAX_NAME:
            raise _fail("name", name, f"a DNS-1035 label: lowercase letters, digits and '-', starting with a "
                        f"letter, ending with a letter or digit, at most {_MAX_NAME} characters (Kubernetes "
                        "names are DNS-1123 labels; KubeRay also wants a leading letter, and appends 6 "
                        "characters to RayJob/RayService names), e.g. 'llama-train'")
        if self.namespace is not None and (not isinstance(self.namespace, str) or len(self.namespace) > 63
                                           or not _DNS1123.fullmatch(self.namespace)):
            raise _fail("namespace", self.namespace, "None or a DNS-1123 label: lowercase letters, digits "
                        "and '-', alphanumeric at both ends, at most 63 characters")
        if not isinstance(self.ray_version, str) or not re.fullmatch(r"\d+\.\d+\.\d+", self.ray_version):
            raise _fail("ray_version", self.ray_version, "the image's Ray version as X.Y.Z, e.g. '2.60.0'")
        for what in ("head_cpu", "head_memory", "worker_cpu", "worker_memory"):
            value = getattr(self, what)
            if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
                raise _fail(what, value, "a Kubernetes quantity string such as '8', '500m', '32Gi' or '40G'")
        if self.entrypoint is not None and (not isinstance(self.entrypoint, str) or not self.entrypoint.strip()):
            raise _fail("entrypoint", self.entrypoint, "None or a non-empty shell command")
        if not isinstance(self.enable_autoscaling, bool):
            raise _fail("enable_autoscaling", self.enable_autoscaling, "True or False")
        path = self.service_import_path
        if path is not None and (not isinstance(path, str) or not _IMPORT_PATH.fullmatch(path)):
            raise _fail("service_import_path", path, f"None (means {DEFAULT_IMPORT_PATH!r}) or "
                        "'package.module:attribute'")

    @property
    def group_name(self) -> str:
        """The TPU worker group's name, which says the shape, e.g. "tpu-v6e-4x4"."""
        return f"tpu-{self.slice.generation}-{self.slice.name}"


def _container(name: str, image: str, resources: dict[str, str], ports: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "image": image, "imagePullPolicy": "IfNotPresent",
                            "resources": {"requests": dict(resources), "limits": dict(resources)}}
    if ports:
        body["ports"] = ports
    return body


def _cluster_spec(spec: ClusterSpec, *, serve: bool) -> dict[str, Any]:
    """The body of a RayCluster's ``spec`` (also a RayJob's ``rayClusterSpec``)."""
    t = spec.slice
    head_ports = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}]
    if serve:
        head_ports.append({"containerPort": SERVE_PORT, "name": "serve"})
    head = {"rayStartParams": {}, "template": {"spec": {"containers": [_container(
        "ray-head", spec.image, {"cpu": spec.head_cpu, "memory": spec.head_memory}, head_ports)]}}}

    worker_ports = [{"containerPort": MEGASCALE_PORT, "name": "mxla"}] if spec.num_slices > 1 else []
    node_selector = {"cloud.google.com/gke-tpu-accelerator": t.gke_accelerator,
                     "cloud.google.com/gke-tpu-topology": t.name}
    if len(chips_per_host_options(t.generation, t.name)) > 1:
        # v5e/v6e 2x4 exists as one 8-chip VM and as two 4-chip VMs with the same
        # labels: pin the machine type so two 4-chip pods never share an 8-chip VM.
        node_selector["node.kubernetes.io/instance-type"] = t.gke_machine_type
    worker_resources = {"cpu": spec.worker_cpu, "memory": spec.worker_memory,
                        "google.com/tpu": str(t.chips_per_host)}
    worker = {
        "groupName": spec.group_name,
        "replicas": 0 if spec.enable_autoscaling else spec.num_slices,
        "minReplicas": 0 if spec.enable_autoscaling else spec.num_slices,
        "maxReplicas": spec.num_slices,
        "numOfHosts": t.num_hosts,
        "rayStartParams": {},
        "template": {"spec": {
            "containers": [_container("ray-worker", spec.image, worker_resources, worker_ports)],
            "nodeSelector": node_selector}},
    }
    body: dict[str, Any] = {"rayVersion": spec.ray_version}
    if spec.enable_autoscaling:
        body["enableInTreeAutoscaling"] = True
    body["headGroupSpec"] = head
    body["workerGroupSpecs"] = [worker]
    return body


def _document(kind: str, spec: ClusterSpec, body: dict[str, Any]) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": spec.name}
    if spec.namespace is not None:
        metadata["namespace"] = spec.namespace
    metadata["labels"] = {"app.kubernetes.io/created-by": "rayslice"}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": body}


def raycluster(spec: ClusterSpec) -> dict[str, Any]:
    """A RayCluster manifest: a CPU head plus ``spec.num_slices`` TPU slices.

    >>> doc = raycluster(ClusterSpec("v5e", "4x8", image="img:1"))
    >>> doc["kind"], doc["spec"]["workerGroupSpecs"][0]["numOfHosts"]
    ('RayCluster', 8)
    """
    return _document("RayCluster", spec, _cluster_spec(spec, serve=True))


def rayjob(spec: ClusterSpec) -> dict[str, Any]:
    """A RayJob manifest: runs ``spec.entrypoint`` on a fresh cluster, then deletes it.

    Raises:
        ValueError: if ``spec.entrypoint`` is None.

    >>> doc = rayjob(ClusterSpec("v4", "2x2x2", image="img:1", entrypoint="python train.py"))
    >>> doc["spec"]["entrypoint"], doc["spec"]["shutdownAfterJobFinishes"]
    ('python train.py', True)
    """
    if spec.entrypoint is None:
        raise ValueError("entrypoint=None is not valid for a RayJob; valid: the shell command the job "
                         "runs on the head, e.g. ClusterSpec(..., entrypoint='python -m my_pkg.train')")
    return _document("RayJob", spec, {"entrypoint": spec.entrypoint, "shutdownAfterJobFinishes": True,
                                      "rayClusterSpec": _cluster_spec(spec, serve=False)})


def _serve_config(spec: ClusterSpec) -> str:
    app: dict[str, Any] = {"name": spec.name, "route_prefix": "/",
                           "import_path": spec.service_import_path or DEFAULT_IMPORT_PATH}
    header = ""
    if app["import_path"] == DEFAULT_IMPORT_PATH:
        t = spec.slice
        app["args"] = {"model": MODEL_PLACEHOLDER, "accelerator_type": t.accelerator_type,
                       "accelerator_config": {"type": "tpu", "topology": t.name,
                                              "chips_per_host": t.chips_per_host},
                       "num_replicas": spec.num_slices}
        header = (f"# Replace args.model ({MODEL_PLACEHOLDER}) with your model class; one replica = one "
                  "slice.\n# Other args (input_spec, init_kwargs, ...): see rayslice.serve.builder.\n")
    config = {"http_options": {"host": "0.0.0.0", "port": SERVE_PORT}, "applications": [app]}
    return header + yaml.safe_dump(config, sort_keys=False)


def rayservice(spec: ClusterSpec) -> dict[str, Any]:
    """A RayService manifest: a Serve application on ``spec.num_slices`` slices.

    ``serveConfigV2`` imports ``spec.service_import_path``, by default
    ``rayslice.serve.builder:app`` with ``args`` filled from the slice shape;
    ``args.model`` is the placeholder ``CHANGE_ME.module:ModelClass`` to replace.

    >>> doc = rayservice(ClusterSpec("v6e", "2x2", image="img:1"))
    >>> yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["import_path"]
    'rayslice.serve.builder:app'
    """
    return _document("RayService", spec, {"serveConfigV2": _serve_config(spec),
                                          "rayClusterConfig": _cluster_spec(spec, serve=True)})


def manifest(kind: str, spec: ClusterSpec) -> dict[str, Any]:
    """The manifest of ``kind`` ("raycluster", "rayjob", "rayservice"; any case).

    >>> manifest("RayCluster", ClusterSpec("v6e", "2x2", image="img:1"))["kind"]
    'RayCluster'
    """
    makers = {"raycluster": raycluster, "rayjob": rayjob, "rayservice": rayservice}
    key = kind.lower() if isinstance(kind, str) else kind
    if key not in makers:
        raise _fail("kind", kind, ", ".join(KINDS))
    return makers[key](spec)


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (serveConfigV2) as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(doc: Mapping[str, Any]) -> str:
    """The manifest as YAML, keys in the order built, ready for ``kubectl apply -f -``.

    >>> print(to_yaml({"apiVersion": "ray.io/v1", "kind": "RayCluster"}), end="")
    apiVersion: ray.io/v1
    kind: RayCluster
    """
    return yaml.dump(dict(doc), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def find_crd_dir() -> Path:
    """The directory holding the KubeRay CRDs (``ray.io_rayclusters.yaml`` ...).

    Looks in ``$RAYSLICE_KUBERAY_CRDS`` when it is set (and nowhere else),
    otherwise in ``shared/kuberay-crds`` next to each directory above this
    module, nearest first: a checkout at ``<root>/main`` finds
    ``<root>/shared/kuberay-crds``, the layout in CI.

    Raises:
        FileNotFoundError: naming every place it looked.

    >>> find_crd_dir().name  # doctest: +SKIP
    'kuberay-crds'
    """
    env = os.environ.get(CRD_DIR_ENV)
    if env:
        path = Path(env).expanduser()
        if not (path / _CRD_FILE["RayCluster"]).is_file():
            raise FileNotFoundError(f"${CRD_DIR_ENV}={env!r} does not hold the KubeRay CRDs "
                                    f"({', '.join(_CRD_FILE.values())})")
        return path
    tried = [p / "shared" / "kuberay-crds" for p in Path(__file__).resolve().parents]
    for path in tried:
        if (path / _CRD_FILE["RayCluster"]).is_file():
            return path
    raise FileNotFoundError(f"no KubeRay CRDs found; set ${CRD_DIR_ENV} to the directory holding "
                            f"{', '.join(_CRD_FILE.values())}. Looked in: {', '.join(map(str, tried))}")


def _strict(schema: Any) -> Any:
    """Makes every object schema reject unknown fields, as the API server does."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=8)
def _validator(path: Path) -> Any:
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as f:
        crd = yaml.load(f, Loader=loader)
    versions = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    if not versions:
        raise ValueError(f"{path} has no v1 version")
    schema = _strict(copy.deepcopy(versions[0]["schema"]["openAPIV3Schema"]))
    formats = jsonschema.FormatChecker(formats=())
    formats.checks("int32")(lambda v: not isinstance(v, int) or -2**31 <= v < 2**31)
    formats.checks("int64")(lambda v: not isinstance(v, int) or -2**63 <= v < 2**63)
    # CRD schemas are OpenAPI v3.0 subsets; Draft 4 has the same keyword meanings
    # (x-kubernetes-* keywords are ignored; int-or-string is an anyOf).
    return jsonschema.Draft4Validator(schema, format_checker=formats)


def _where(path: Any) -> str:
    """``spec.workerGroupSpecs[0].numOfHosts`` from a jsonschema error path."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text or "<document>"


def validate(doc: Mapping[str, Any], crd_dir: str | os.PathLike[str] | None = None) -> None:
    """Checks a manifest against ``spec.versions[v1].schema.openAPIV3Schema`` of its CRD.

    Unknown fields are errors (like ``kubectl apply``'s strict validation);
    CEL rules (``x-kubernetes-validations``) are not evaluated.

    Args:
        doc: A manifest from :func:`manifest` (or loaded from YAML).
        crd_dir: Directory of the CRDs; default :func:`find_crd_dir`.

    Raises:
        ManifestError: listing every mismatch with its path in the document.
        FileNotFoundError: if the CRD file cannot be found.

    >>> validate(raycluster(ClusterSpec("v6e", "4x4", image="img:1")))  # doctest: +SKIP
    """
    kind = doc.get("kind") if isinstance(doc, Mapping) else None
    if kind not in _CRD_FILE or doc.get("apiVersion") != API_VERSION:
        got = (doc.get("apiVersion"), kind) if isinstance(doc, Mapping) else type(doc).__name__
        raise ManifestError(f"not a KubeRay {API_VERSION} manifest: {got!r}; valid kinds: "
                            f"{', '.join(_CRD_FILE)}", [])
    path = Path(crd_dir) if crd_dir is not None else find_crd_dir()
    path = (path / _CRD_FILE[kind]).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"KubeRay CRD for {kind} not found: {path}")
    errors = sorted(_validator(path).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = [f"{_where(e.absolute_path)}: {e.message}" for e in errors]
        raise ManifestError(f"{kind} {doc.get('metadata', {}).get('name')!r} does not match the KubeRay "
                            f"CRD ({path.name}):\n  " + "\n  ".join(lines), lines)
