"""What a slice deployment reserves and how it batches, parsed once (pure, no Ray).

:class:`SliceServeConfig` is built when a deployment is declared: it parses
the slice request once (:class:`~rayslice.request.SliceRequest`) and every
replica passes that value whole to the reservation. ``accelerator_config``
takes Ray Serve LLM's shape (``{"kind": "tpu", "topology": "4x4"}``, or its
``TPUConfig`` object) as well as rayslice's older ``{"type": "tpu", ...}``.

Example:
    >>> cfg = SliceServeConfig.from_accelerator_config("TPU-V4", {"kind": "tpu", "topology": "2x2x2"})
    >>> cfg.request.num_hosts, str(cfg.request)
    (2, '1 x v4 2x2x2 (8 chips, 2 hosts x 4)')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rayslice._validate import check_float, check_int, check_optional, check_str, fail
from rayslice.request import SliceRequest
from rayslice.serve.schema import InputSpec
from rayslice.topology import Topology

__all__ = ["SliceServeConfig", "parse_accelerator_config"]

_KIND_KEYS = ("kind", "type")  # Ray Serve LLM's TPUConfig says "kind"; rayslice said "type"
_CHIPS_KEYS = ("chips_per_host", "chips_per_vm")  # rayslice's name, and ray.util.tpu's


def _as_mapping(accelerator_config: object) -> dict[str, Any]:
    """A plain dict from a mapping or a Ray Serve LLM ``TPUConfig`` (a pydantic model)."""
    if isinstance(accelerator_config, Mapping):
        return dict(accelerator_config)
    dump = getattr(accelerator_config, "model_dump", None)
    if callable(dump) and hasattr(accelerator_config, "kind"):
        return {k: v for k, v in dump().items() if v is not None}
    hint = ""
    if isinstance(accelerator_config, str):
        hint = f" (e.g. {{'kind': 'tpu', 'topology': {accelerator_config!r}}})"
    raise fail(
        "accelerator_config",
        accelerator_config,
        f"a mapping such as {{'kind': 'tpu', 'topology': '2x2x2'}}{hint}",
        got_type=True,
    )


def _one_of(cfg: dict[str, Any], keys: tuple[str, str]) -> Any:
    """The value under either spelling of one key; both spellings must agree (strings in any case)."""
    given = {k: cfg.pop(k) for k in keys if k in cfg}
    if len({repr(v.strip().lower() if isinstance(v, str) else v) for v in given.values()}) > 1:
        raise fail(
            f"accelerator_config[{keys[0]!r}]",
            given,
            f"one of {keys[0]!r} or {keys[1]!r} (they mean the same), or equal values",
        )
    return next(iter(given.values()), None)


def parse_accelerator_config(accelerator_type: str | None, accelerator_config: object) -> SliceRequest:
    """The slice one replica reserves, from Serve-style ``accelerator_type`` + ``accelerator_config``.

    Accepts Ray Serve LLM's shape (``{"kind": "tpu", "topology": "4x4"}``, or
    its ``TPUConfig`` object) and rayslice's (``{"type": "tpu", ...}``), with
    ``chips_per_host`` (or ray.util.tpu's ``chips_per_vm``) for shapes with two
    host layouts. A topology is required: a replica owns one whole slice.

    Raises:
        InvalidArgument: naming the key, the bad value and what is valid.

    Example:
        >>> parse_accelerator_config("TPU-V6E", {"kind": "tpu", "topology": "2x4", "chips_per_vm": 4}).num_hosts
        2
        >>> parse_accelerator_config("TPU-V4", "2x2x2")
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: accelerator_config='2x2x2' is not valid: expected a mapping such as \
{'kind': 'tpu', 'topology': '2x2x2'} (e.g. {'kind': 'tpu', 'topology': '2x2x2'}), got str
    """
    cfg = _as_mapping(accelerator_config)
    kind = _one_of(cfg, _KIND_KEYS)
    kind = "tpu" if kind is None else kind
    if not isinstance(kind, str) or kind.strip().lower() != "tpu":
        raise fail(
            "accelerator_config['kind']", kind, f"'tpu' (accelerator_config type {kind!r} is not supported; valid: tpu)"
        )
    topology = cfg.pop("topology", None)
    if topology is None:
        raise fail(
            "accelerator_config",
            dict(accelerator_config) if isinstance(accelerator_config, Mapping) else accelerator_config,
            "a 'topology' (accelerator_config needs a 'topology': one replica owns one whole slice), "
            "e.g. {'kind': 'tpu', 'topology': '2x2x2'}",
        )
    if not isinstance(topology, str | Topology):
        raise fail("accelerator_config['topology']", topology, "a shape string such as '2x2x2' or '4x4'", got_type=True)
    chips = check_optional(check_int, "accelerator_config['chips_per_host']", _one_of(cfg, _CHIPS_KEYS), minimum=1)
    if cfg:
        raise fail(
            "accelerator_config",
            sorted(cfg),
            "only the keys kind (or type), topology, chips_per_host (or chips_per_vm); unknown keys",
        )
    if accelerator_type is not None:
        check_str("accelerator_type", accelerator_type)
    elif not isinstance(topology, Topology):
        raise fail("accelerator_type", accelerator_type, "a TPU generation such as 'TPU-V6E' or 'v4'")
    try:
        request = SliceRequest.parse(topology, accelerator_type, chips_per_host=chips)
    except (TypeError, ValueError) as e:
        raise fail("accelerator_config['topology']", topology, f"a valid shape: {e}") from None
    return request


@dataclasses.dataclass(frozen=True)
class SliceServeConfig:
    """How a slice deployment reserves, batches and validates. Validated on construction.

    Args:
        accelerator_type: Generation, e.g. ``"TPU-V4"`` (None when ``topology``
            is already a ``Topology`` or ``SliceRequest``).
        topology: Chip shape (``"2x2x2"``), a ``Topology`` or a one-slice ``SliceRequest``.
        chips_per_host: For shapes with two host layouts (v5e/v6e ``2x4``).
        input_spec: Per-column row shape and dtype (an ``InputSpec`` or its mapping form).
        reservation_timeout_s: Longest wait for a slice at replica start-up.
        init_timeout_s: Deadline for the host processes and ``setup``.
        request_timeout_s: Deadline of one SPMD step (503 past it).
        body_timeout_s: Deadline for an HTTP request's body to arrive (408 past it).
        max_batch_size: Rows in one SPMD step; also the per-request row limit.
        batch_wait_timeout_s: How long a batch waits for more requests.
        max_body_bytes: Larger HTTP bodies get 413.

    Attributes:
        request: The :class:`~rayslice.request.SliceRequest`, parsed once here
            and passed whole to the reservation.

    Example:
        >>> cfg = SliceServeConfig("TPU-V4", "2x2x2")
        >>> cfg.request.num_hosts, cfg.topology_info is cfg.request.topology
        (2, True)
        >>> SliceServeConfig("TPU-V4", "2x2x2", max_batch_size=0)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: max_batch_size=0 is not valid: expected an integer >= 1 and <= 65536
    """

    accelerator_type: str | None
    topology: str | Topology | SliceRequest
    chips_per_host: int | None = None
    input_spec: InputSpec | Mapping[str, Any] | None = None
    reservation_timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    request_timeout_s: float = 30.0
    body_timeout_s: float = 10.0
    max_batch_size: int = 32
    batch_wait_timeout_s: float = 0.002
    max_body_bytes: int = 1 << 20
    request: SliceRequest = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_optional(check_str, "accelerator_type", self.accelerator_type)
        check_optional(check_int, "chips_per_host", self.chips_per_host, minimum=1)
        if not isinstance(self.topology, str | Topology | SliceRequest):
            raise fail(
                "topology", self.topology, "a shape string such as '2x2x2', a Topology or a SliceRequest", got_type=True
            )
        for name in ("reservation_timeout_s", "init_timeout_s", "request_timeout_s", "body_timeout_s"):
            check_float(name, getattr(self, name), minimum=0, exclusive_min=True, maximum=7 * 24 * 3600)
        set_ = object.__setattr__
        set_(self, "max_batch_size", check_int("max_batch_size", self.max_batch_size, minimum=1, maximum=1 << 16))
        set_(self, "max_body_bytes", check_int("max_body_bytes", self.max_body_bytes, minimum=1, maximum=1 << 34))
        set_(
            self,
            "batch_wait_timeout_s",
            check_float("batch_wait_timeout_s", self.batch_wait_timeout_s, minimum=0, maximum=60),
        )
        if self.input_spec is not None and not isinstance(self.input_spec, InputSpec):
            set_(self, "input_spec", InputSpec.parse(self.input_spec, max_rows=self.max_batch_size))
        try:
            request = SliceRequest.parse(self.topology, self.accelerator_type, chips_per_host=self.chips_per_host)
        except (TypeError, ValueError) as e:
            raise fail("topology", self.topology, f"a valid slice shape: {e}") from None
        if request.num_slices != 1:
            raise fail("topology", self.topology, "a request for one slice (a replica owns exactly one slice)")
        set_(self, "request", request)

    @property
    def topology_info(self) -> Topology:
        """The parsed topology (``request.topology``)."""
        return self.request.topology

    @classmethod
    def from_accelerator_config(
        cls, accelerator_type: str | None, accelerator_config: object, **kwargs: Any
    ) -> SliceServeConfig:
        """From Serve-style ``accelerator_config={"kind": "tpu", "topology": "2x2x2"}`` (see
        :func:`parse_accelerator_config`); ``kwargs`` are the other fields.

        Example:
            >>> SliceServeConfig.from_accelerator_config("v6e", {"type": "tpu", "topology": "4x4"}).request.num_hosts
            4
        """
        request = parse_accelerator_config(accelerator_type, accelerator_config)
        return cls(None, request, **kwargs)
