"""KubeRay manifests (RayCluster, RayJob, RayService) for whole TPU slices on GKE.

Every TPU fact (hosts per slice, chips per host, GKE labels, the Megascale
port) comes from :mod:`rayslice.topology`; this module is pure manifest code
and imports neither Ray nor JAX. The layout follows KubeRay's and GKE's TPU
samples field by field (KubeRay ``ray-cluster.tpu-v6e-16-multihost.yaml``,
``ray-cluster.tpu-v6e-singlehost.yaml``, ``ray-cluster.tpu-v4-multihost.yaml``;
GKE ``ai-ml/gke-ray/tpu/ray-job.tpu-v6e-multihost.yaml`` and
``ai-ml/gke-ray/raytrain/torchtpu/ray-cluster.tpu-v7x-multihost.yaml``):

- a CPU-only head (no TPU node selector) and ONE TPU worker group whose
  replicas are slices, ``numOfHosts`` pods per replica, ``google.com/tpu``
  requests and limits equal to the chips of one host, and the
  ``cloud.google.com/gke-tpu-accelerator`` / ``gke-tpu-topology`` node
  selectors (plus the machine type where one shape has two host layouts);
- ``rayStartParams`` empty: KubeRay turns the ``google.com/tpu`` limit into
  Ray's ``TPU`` resource itself, and Ray detects the TPU type and slice on GKE;
- ``rayVersion`` (KubeRay picks its health probes from it): ``ray_version``,
  else the version in a ``rayproject/ray:X.Y.Z...`` image tag, else the Ray
  rayslice is pinned to (:data:`PINNED_RAY_VERSION`);
- multi-host v6e and v7x workers get the environment of the samples:
  ``NODE_IP`` from the downward API (``status.hostIP``),
  ``VBAR_CONTROL_SERVICE_URL=$(NODE_IP):8353``, ``JAX_PLATFORMS=tpu,cpu`` and
  ``ENABLE_PJRT_COMPATIBILITY=true`` (:func:`tpu_worker_env`); single-host
  slices and v4/v5e/v5p get none, as in their samples. The v7x sample's
  ``RAY_TPU_RESOURCE_PER_CHIP=2`` is left out on purpose: it would make Ray
  count TensorCores instead of chips, and rayslice reserves whole hosts by
  ``TPU`` = chips per host;
- multi-slice groups (``num_slices > 1``) open port 8081 (``mxla``), the
  :data:`~rayslice.topology.MEGASCALE_PORT` rayslice gives libtpu. GKE
  Multislice joins multi-host slices only, so ``num_slices > 1`` of a
  single-host shape is refused.

:func:`validate` checks a manifest against the KubeRay CRDs shipped in the
package (``rayslice/kuberay_crds``, see its README for the KubeRay commit), or
those in ``$RAYSLICE_KUBERAY_CRDS``.

>>> spec = ClusterSpec("TPU-V6E", "4x4", num_slices=2, image="rayproject/ray:2.60.0")
>>> group = raycluster(spec)["spec"]["workerGroupSpecs"][0]
>>> group["groupName"], group["numOfHosts"], group["replicas"]
('tpu-v6e-4x4', 4, 2)
>>> validate(raycluster(spec))  # against the bundled KubeRay CRDs
"""

from __future__ import annotations

import copy
import importlib.resources
import os
import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from rayslice._validate import fail
from rayslice.errors import RaysliceError
from rayslice.topology import MEGASCALE_PORT, Topology, chips_per_host_options, valid_topologies

__all__ = [
    "CRD_DIR_ENV",
    "KINDS",
    "PINNED_RAY_VERSION",
    "CRDNotFoundError",
    "ClusterSpec",
    "ManifestError",
    "find_crd_dir",
    "manifest",
    "ray_version_of_image",
    "raycluster",
    "rayjob",
    "rayservice",
    "to_yaml",
    "tpu_worker_env",
    "validate",
]

API_VERSION = "ray.io/v1"
CRD_DIR_ENV = "RAYSLICE_KUBERAY_CRDS"
#: The package-data directory (inside ``rayslice``) that holds the bundled CRDs.
CRD_PACKAGE_DIR = "kuberay_crds"
KINDS: tuple[str, ...] = ("raycluster", "rayjob", "rayservice")
_CRD_FILE = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
#: The Ray version rayslice is pinned to (pyproject.toml); the default ``rayVersion``.
PINNED_RAY_VERSION = "2.60.0"
DEFAULT_IMPORT_PATH = "rayslice.serve.builder:app"
MODEL_PLACEHOLDER = "CHANGE_ME.module:ModelClass"
SERVE_PORT = 8000
#: Port of the TPU VM's VBAR control service (v6e/v7x), as in GKE's samples.
VBAR_CONTROL_PORT = 8353
_VBAR_GENERATIONS = ("v6e", "v7x")

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
_RAY_VERSION = re.compile(r"\d+\.\d+\.\d+")
# rayproject/ray (or ray-ml, ray-llm) from any registry, tag starting with X.Y.Z.
_RAY_IMAGE_TAG = re.compile(r"(?:^|/)rayproject/ray(?:-ml|-llm)?:(\d+\.\d+\.\d+)(?![\d.])")


class ManifestError(ValueError):
    """A manifest does not match its KubeRay CRD; ``errors`` lists every problem."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


class CRDNotFoundError(RaysliceError, FileNotFoundError):
    """The KubeRay CRDs are not where ``$RAYSLICE_KUBERAY_CRDS`` (or the package) says."""


def ray_version_of_image(image: str) -> str | None:
    """The Ray version in an official Ray image's tag, or None for any other image.

    >>> ray_version_of_image("rayproject/ray:2.60.0-py311-cpu")
    '2.60.0'
    >>> ray_version_of_image("docker.io/rayproject/ray-ml:2.9.3-gpu")
    '2.9.3'
    >>> ray_version_of_image("us-docker.pkg.dev/p/r/rayslice:0.1.0") is None
    True
    """
    m = _RAY_IMAGE_TAG.search(image)
    return m.group(1) if m else None


def _multi_host_hint(t: Topology) -> str:
    options = [s for s in valid_topologies(t.generation) if Topology.parse(t.generation, s).num_hosts > 1]
    hint = f"a multi-host {t.generation} topology (e.g. {', '.join(options[:2])})"
    if 4 in chips_per_host_options(t.generation, t.name) and t.chips_per_host != 4:
        hint += f", or {t.name} as 4-chip hosts (chips_per_host=4)"
    return hint


@dataclass(frozen=True)
class ClusterSpec:
    """What to run: a TPU slice shape, how many slices, and the pods around them.

    Validated on construction: a bad value raises
    :class:`~rayslice.errors.InvalidArgument` (a ValueError) naming it and
    saying what is valid. ``accelerator`` takes any spelling the catalog knows
    ("v6e", "TPU-V6E", "tpu-v6e-slice", "trillium"). ``name`` must be a DNS-1035
    label of at most 47 characters (KubeRay's rule for RayJob/RayService names).
    ``ray_version`` is the image's Ray version (KubeRay's ``rayVersion``, which
    picks its health probes); None means the version in a
    ``rayproject/ray:X.Y.Z...`` image tag, else :data:`PINNED_RAY_VERSION`.
    ``num_slices > 1`` needs a multi-host shape (GKE Multislice).
    ``worker_cpu``/``worker_memory`` default to what fits every TPU host type,
    the smallest being ct5lp-hightpu-1t (24 vCPUs, 48 GB). With
    ``enable_autoscaling`` the group starts at 0 slices and the Ray autoscaler
    adds whole slices, up to ``num_slices``.

    >>> ClusterSpec("v4", "2x2x2", image="img:1").slice.num_hosts
    2
    >>> ClusterSpec("v4", "2x2x2", image="rayproject/ray:2.59.1-py311").ray_version
    '2.59.1'
    >>> ClusterSpec("v4", "2x2x2", image="img:1", name="My_Job")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rayslice.errors.InvalidArgument: name='My_Job' is not valid: expected a DNS-1035 label: ...
    >>> ClusterSpec("v6e", "2x2", image="img:1", num_slices=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rayslice.errors.InvalidArgument: num_slices=2 is not valid: expected 1 for v6e 2x2, a single-host slice ...
    """

    accelerator: str
    topology: str
    _: KW_ONLY
    image: str
    num_slices: int = 1
    name: str = "rayslice"
    chips_per_host: int | None = None
    ray_version: str | None = None  # resolved in __post_init__: always a str afterwards
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
        t = Topology.parse(self.accelerator, self.topology, chips_per_host=self.chips_per_host)
        object.__setattr__(self, "slice", t)
        if not isinstance(self.image, str) or not self.image.strip() or re.search(r"\s", self.image):
            raise fail(
                "image",
                self.image,
                "a non-empty container image reference without spaces, "
                "e.g. 'rayproject/ray:2.60.0-py311' (with rayslice and jax[tpu] installed)",
            )
        if type(self.num_slices) is not int or not 1 <= self.num_slices <= 2**31 - 1:
            raise fail("num_slices", self.num_slices, "an int >= 1")
        if self.num_slices > 1 and t.num_hosts == 1:
            raise fail(
                "num_slices",
                self.num_slices,
                f"1 for {t.generation} {t.name}, a single-host slice "
                f"(GKE Multislice joins multi-host TPU slices only); for several slices use "
                f"{_multi_host_hint(t)}",
            )
        name = self.name
        if not isinstance(name, str) or not _DNS1035.fullmatch(name) or len(name) > _MAX_NAME:
            raise fail(
                "name",
                name,
                f"a DNS-1035 label: lowercase letters, digits and '-', starting with a "
                f"letter, ending with a letter or digit, at most {_MAX_NAME} characters (Kubernetes "
                "names are DNS-1123 labels; KubeRay also wants a leading letter, and appends 6 "
                "characters to RayJob/RayService names), e.g. 'llama-train'",
            )
        if self.namespace is not None and (
            not isinstance(self.namespace, str) or len(self.namespace) > 63 or not _DNS1123.fullmatch(self.namespace)
        ):
            raise fail(
                "namespace",
                self.namespace,
                "None or a DNS-1123 label: lowercase letters, digits "
                "and '-', alphanumeric at both ends, at most 63 characters",
            )
        if self.ray_version is None:
            object.__setattr__(self, "ray_version", ray_version_of_image(self.image) or PINNED_RAY_VERSION)
        elif not isinstance(self.ray_version, str) or not _RAY_VERSION.fullmatch(self.ray_version):
            raise fail(
                "ray_version",
                self.ray_version,
                "None (from a rayproject/ray:X.Y.Z image tag, else "
                f"{PINNED_RAY_VERSION}) or the image's Ray version as X.Y.Z, e.g. '2.60.0'",
            )
        for what in ("head_cpu", "head_memory", "worker_cpu", "worker_memory"):
            value = getattr(self, what)
            if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
                raise fail(what, value, "a Kubernetes quantity string such as '8', '500m', '32Gi' or '40G'")
        if self.entrypoint is not None and (not isinstance(self.entrypoint, str) or not self.entrypoint.strip()):
            raise fail("entrypoint", self.entrypoint, "None or a non-empty shell command")
        if not isinstance(self.enable_autoscaling, bool):
            raise fail("enable_autoscaling", self.enable_autoscaling, "True or False")
        path = self.service_import_path
        if path is not None and (not isinstance(path, str) or not _IMPORT_PATH.fullmatch(path)):
            raise fail(
                "service_import_path", path, f"None (means {DEFAULT_IMPORT_PATH!r}) or 'package.module:attribute'"
            )

    @property
    def group_name(self) -> str:
        """The TPU worker group's name, which says the shape, e.g. "tpu-v6e-4x4"."""
        return f"tpu-{self.slice.generation}-{self.slice.name}"


def tpu_worker_env(t: Topology) -> list[dict[str, Any]]:
    """The container ``env`` of a TPU worker pod, as GKE's and KubeRay's samples set it.

    Multi-host v6e and v7x slices: the VBAR control service on the node
    (``$(NODE_IP):8353``, ``NODE_IP`` from the downward API), JAX on TPU with
    CPU as fallback, and libtpu's PJRT compatibility mode. Anything else: none.

    >>> [e["name"] for e in tpu_worker_env(Topology.parse("v6e", "4x4"))]
    ['NODE_IP', 'VBAR_CONTROL_SERVICE_URL', 'JAX_PLATFORMS', 'ENABLE_PJRT_COMPATIBILITY']
    >>> tpu_worker_env(Topology.parse("v6e", "2x2")), tpu_worker_env(Topology.parse("v4", "2x2x2"))
    ([], [])
    """
    if t.generation not in _VBAR_GENERATIONS or t.num_hosts == 1:
        return []
    return [
        {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "VBAR_CONTROL_SERVICE_URL", "value": f"$(NODE_IP):{VBAR_CONTROL_PORT}"},
        {"name": "JAX_PLATFORMS", "value": "tpu,cpu"},
        {"name": "ENABLE_PJRT_COMPATIBILITY", "value": "true"},
    ]


def _container(
    name: str,
    image: str,
    resources: dict[str, str],
    ports: list[dict[str, Any]],
    env: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": dict(resources), "limits": dict(resources)},
    }
    if env:
        body["env"] = env
    if ports:
        body["ports"] = ports
    return body


def _cluster_spec(spec: ClusterSpec, *, serve: bool) -> dict[str, Any]:
    """The body of a RayCluster's ``spec`` (also a RayJob's ``rayClusterSpec``)."""
    t = spec.slice
    head_ports = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
    ]
    if serve:
        head_ports.append({"containerPort": SERVE_PORT, "name": "serve"})
    head = {
        "rayStartParams": {},
        "template": {
            "spec": {
                "containers": [
                    _container("ray-head", spec.image, {"cpu": spec.head_cpu, "memory": spec.head_memory}, head_ports)
                ]
            }
        },
    }

    worker_ports = [{"containerPort": MEGASCALE_PORT, "name": "mxla"}] if spec.num_slices > 1 else []
    node_selector = {
        "cloud.google.com/gke-tpu-accelerator": t.gke_accelerator,
        "cloud.google.com/gke-tpu-topology": t.name,
    }
    if len(chips_per_host_options(t.generation, t.name)) > 1:
        # v5e/v6e 2x4 exists as one 8-chip VM and as two 4-chip VMs with the same
        # labels: pin the machine type so two 4-chip pods never share an 8-chip VM.
        node_selector["node.kubernetes.io/instance-type"] = t.gke_machine_type
    worker_resources = {"cpu": spec.worker_cpu, "memory": spec.worker_memory, "google.com/tpu": str(t.chips_per_host)}
    worker = {
        "groupName": spec.group_name,
        "replicas": 0 if spec.enable_autoscaling else spec.num_slices,
        "minReplicas": 0 if spec.enable_autoscaling else spec.num_slices,
        "maxReplicas": spec.num_slices,
        "numOfHosts": t.num_hosts,
        "rayStartParams": {},
        "template": {
            "spec": {
                "containers": [_container("ray-worker", spec.image, worker_resources, worker_ports, tpu_worker_env(t))],
                "nodeSelector": node_selector,
            }
        },
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
        InvalidArgument: if ``spec.entrypoint`` is None (a ValueError).

    >>> doc = rayjob(ClusterSpec("v4", "2x2x2", image="img:1", entrypoint="python train.py"))
    >>> doc["spec"]["entrypoint"], doc["spec"]["shutdownAfterJobFinishes"]
    ('python train.py', True)
    """
    if spec.entrypoint is None:
        raise fail(
            "entrypoint",
            None,
            "for a RayJob, the shell command the job runs on the head, "
            "e.g. ClusterSpec(..., entrypoint='python -m my_pkg.train')",
        )
    return _document(
        "RayJob",
        spec,
        {
            "entrypoint": spec.entrypoint,
            "shutdownAfterJobFinishes": True,
            "rayClusterSpec": _cluster_spec(spec, serve=False),
        },
    )


def _serve_config(spec: ClusterSpec) -> str:
    app: dict[str, Any] = {
        "name": spec.name,
        "route_prefix": "/",
        "import_path": spec.service_import_path or DEFAULT_IMPORT_PATH,
    }
    header = ""
    if app["import_path"] == DEFAULT_IMPORT_PATH:
        t = spec.slice
        app["args"] = {
            "model": MODEL_PLACEHOLDER,
            "accelerator_type": t.accelerator_type,
            "accelerator_config": {"type": "tpu", "topology": t.name, "chips_per_host": t.chips_per_host},
            "num_replicas": spec.num_slices,
        }
        header = (
            f"# Replace args.model ({MODEL_PLACEHOLDER}) with your model class; one replica = one "
            "slice.\n# Other args (input_spec, init_kwargs, ...): see rayslice.serve.builder.\n"
        )
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
    return _document(
        "RayService", spec, {"serveConfigV2": _serve_config(spec), "rayClusterConfig": _cluster_spec(spec, serve=True)}
    )


def manifest(kind: str, spec: ClusterSpec) -> dict[str, Any]:
    """The manifest of ``kind`` ("raycluster", "rayjob", "rayservice"; any case).

    >>> manifest("RayCluster", ClusterSpec("v6e", "2x2", image="img:1"))["kind"]
    'RayCluster'
    """
    makers = {"raycluster": raycluster, "rayjob": rayjob, "rayservice": rayservice}
    key = kind.lower() if isinstance(kind, str) else kind
    if key not in makers:
        raise fail("kind", kind, ", ".join(KINDS))
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


def _missing(directory: Path | Traversable) -> list[str]:
    return [f for f in _CRD_FILE.values() if not directory.joinpath(f).is_file()]


def find_crd_dir() -> Path | Traversable:
    """The directory holding the KubeRay CRDs (``ray.io_rayclusters.yaml`` ...).

    ``$RAYSLICE_KUBERAY_CRDS`` when it is set and not empty, else the CRDs
    shipped in the package (``rayslice/kuberay_crds``, read with
    :mod:`importlib.resources`).

    Raises:
        CRDNotFoundError: (a ``FileNotFoundError``) if ``$RAYSLICE_KUBERAY_CRDS``
            is not a directory holding the three CRD files, or the package's own
            copy is missing (a broken install). Never falls back silently.

    >>> sorted(p.name for p in find_crd_dir().iterdir() if p.name.endswith(".yaml"))
    ['ray.io_rayclusters.yaml', 'ray.io_rayjobs.yaml', 'ray.io_rayservices.yaml']
    """
    env = os.environ.get(CRD_DIR_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise CRDNotFoundError(
                f"${CRD_DIR_ENV}={env!r} is not a directory; set it to a directory "
                f"holding {', '.join(_CRD_FILE.values())}, or unset it to use the "
                "KubeRay CRDs shipped with rayslice"
            )
        if missing := _missing(path):
            raise CRDNotFoundError(
                f"${CRD_DIR_ENV}={env!r} does not hold the KubeRay CRDs: {', '.join(missing)} missing"
            )
        return path
    bundled = importlib.resources.files("rayslice").joinpath(CRD_PACKAGE_DIR)
    if missing := _missing(bundled):
        raise CRDNotFoundError(
            f"the KubeRay CRDs shipped with rayslice are missing from {bundled} "
            f"({', '.join(missing)}): reinstall rayslice, or set ${CRD_DIR_ENV}"
        )
    return bundled


def _strict(schema: Any) -> Any:
    """Makes every object schema reject unknown fields, as the API server does."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


_VALIDATORS: dict[str, Any] = {}  # by CRD file: parsing a CRD takes ~0.5 s


def _validator(crd: Path | Traversable) -> Any:
    key = str(crd)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = _load_validator(crd)
    return _VALIDATORS[key]


def _load_validator(crd: Path | Traversable) -> Any:
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with crd.open("rb") as f:
        doc = yaml.load(f, Loader=loader)  # a safe loader: CSafeLoader or SafeLoader
    versions = [v for v in doc["spec"]["versions"] if v["name"] == "v1"]
    if not versions:
        raise ValueError(f"{crd} has no v1 version")
    schema = _strict(copy.deepcopy(versions[0]["schema"]["openAPIV3Schema"]))
    formats = jsonschema.FormatChecker(formats=())
    formats.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)
    formats.checks("int64")(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**63)
    # CRD schemas are OpenAPI v3.0 subsets; Draft 4 has the same keyword meanings
    # (x-kubernetes-* keywords are ignored; int-or-string is an anyOf).
    return jsonschema.Draft4Validator(schema, format_checker=formats)


def _where(path: Any) -> str:
    """``spec.workerGroupSpecs[0].numOfHosts`` from a jsonschema error path."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text or "<document>"


def validate(doc: Mapping[str, Any], crd_dir: str | os.PathLike[str] | Traversable | None = None) -> None:
    """Checks a manifest against the v1 OpenAPI schema of its KubeRay CRD.

    What is checked, exactly:

    - ``apiVersion`` is ``ray.io/v1`` and ``kind`` is RayCluster, RayJob or
      RayService;
    - the whole document against ``spec.versions[name=v1].schema.openAPIV3Schema``
      of that kind's CRD, with JSON Schema Draft 4 semantics (the OpenAPI v3.0
      subset CRDs use): ``type``, ``required``, ``enum``, ``pattern``,
      ``minimum``/``maximum``, ``minLength``/``maxLength``, ``minItems``/``maxItems``,
      ``additionalProperties`` maps, and int-or-string quantities (``anyOf``);
      formats ``int32`` and ``int64`` are range-checked, other formats
      (``date-time``) are not;
    - unknown fields are errors in every object schema, except below
      ``x-kubernetes-preserve-unknown-fields`` (like ``kubectl apply``'s strict
      field validation, where the API server's default only warns and drops them).

    Stricter than the API server on defaulted fields: the server fills in
    ``default`` values and prunes ``null`` values before it validates, this
    validator does neither, so a missing required field that has a default, or
    an explicit ``null``, is an error here. Not checked: CEL rules
    (``x-kubernetes-validations``), list-map/set uniqueness
    (``x-kubernetes-list-type``), ``metadata`` beyond its schema (names are
    checked by :class:`ClusterSpec`), Kubernetes' own pod-template validation,
    and KubeRay's webhook/controller checks.

    Args:
        doc: A manifest from :func:`manifest` (or loaded from YAML); not modified.
        crd_dir: Directory of the CRDs; default :func:`find_crd_dir` (the
            bundled CRDs, or ``$RAYSLICE_KUBERAY_CRDS``).

    Raises:
        ManifestError: (a ``ValueError``) listing every mismatch with its path
            in the document, one per line.
        CRDNotFoundError: (a ``FileNotFoundError``) if the CRD file is missing.

    >>> validate(raycluster(ClusterSpec("v6e", "4x4", image="img:1")))
    >>> bad = raycluster(ClusterSpec("v6e", "4x4", image="img:1"))
    >>> bad["spec"]["workerGroupSpecs"][0]["numOfHost"] = 4
    >>> validate(bad)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rayslice.k8s.ManifestError: RayCluster 'rayslice' does not match ...('numOfHost' was unexpected)
    """
    kind = doc.get("kind") if isinstance(doc, Mapping) else None
    if kind not in _CRD_FILE or doc.get("apiVersion") != API_VERSION:
        got = (doc.get("apiVersion"), kind) if isinstance(doc, Mapping) else type(doc).__name__
        raise ManifestError(f"not a KubeRay {API_VERSION} manifest: {got!r}; valid kinds: {', '.join(_CRD_FILE)}", [])
    directory = find_crd_dir() if crd_dir is None else _as_dir(crd_dir)
    crd = directory.joinpath(_CRD_FILE[kind])
    if not crd.is_file():
        raise CRDNotFoundError(f"KubeRay CRD for {kind} not found: {crd}")
    errors = sorted(_validator(crd).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = [f"{_where(e.absolute_path)}: {e.message}" for e in errors]
        raise ManifestError(
            f"{kind} {doc.get('metadata', {}).get('name')!r} does not match the KubeRay "
            f"CRD ({_CRD_FILE[kind]}):\n  " + "\n  ".join(lines),
            lines,
        )


def _as_dir(crd_dir: str | os.PathLike[str] | Traversable) -> Path | Traversable:
    if isinstance(crd_dir, (str, os.PathLike)):
        return Path(crd_dir).resolve()
    return crd_dir
