"""Run a function once per host of a slice: :func:`run_on_slice`.

The one-call way to use a slice: reserve it (or take one the caller already
holds, Ray's ``tpu_slice=``), run ``fn`` on every host, release. A plain
function runs in a :class:`~rayslice.gang.SliceGang` with ``jax.distributed``
up and its results come back; a ``@ray.remote`` function is dispatched as
Ray's ``ray.util.tpu.run_on_slice`` does (one task per host bundle) and its
ObjectRefs come back.

Example:
    >>> def count():
    ...     import jax
    ...     return jax.device_count()
    >>> run_on_slice(count, topology="2x2x2", accelerator_type="TPU-V4")  # doctest: +SKIP
    [8, 8]
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from rayslice._validate import (
    check_callable,
    check_float,
    check_int,
    check_optional,
    fail,
)
from rayslice.gang import SliceGang
from rayslice.placement import SlicePlacementGroup, slice_placement_group
from rayslice.request import SliceRequest
from rayslice.topology import Topology

__all__ = ["run_on_slice"]


def _is_ray_remote_function(fn: Any) -> bool:
    return hasattr(fn, "options") and hasattr(fn, "remote") and not isinstance(fn, type)


def run_on_slice(
    fn: Callable[..., Any],
    *args: Any,
    topology: str | Topology | SliceRequest | None = None,
    accelerator_type: str | None = None,
    tpu_slice: SlicePlacementGroup | None = None,
    slice_index: int | None = None,
    num_slices: int | None = None,
    chips_per_host: int | None = None,
    accelerator_version: str | None = None,
    chips_per_vm: int | None = None,
    timeout_s: float = 300.0,
    head_reservation_timeout_s: float | None = None,
    pg_ready_timeout_s: float | None = None,
    init_timeout_s: float = 120.0,
    run_timeout_s: float | None = None,
    fn_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn`` once per host of a slice: on slices it reserves, or on ``tpu_slice`` you hold.

    Two forms, told apart by ``fn``:

    * A plain function (rayslice's form): one gang process per host with
      ``jax.distributed`` up; blocks and returns the per-host **results** in
      (slice, worker id) order. ``timeout_s`` bounds the wait for slices,
      ``init_timeout_s`` the start of the processes, ``run_timeout_s`` (None:
      no limit) the run of ``fn``.
    * A ``@ray.remote`` function (Ray's form, as ``ray.util.tpu.run_on_slice``):
      one task per host pinned to its bundle (``num_cpus=0`` and the host's
      chips as ``TPU``); returns the list of **ObjectRefs** at once, for
      ``ray.get``. A slice reserved here is released as soon as every task
      has finished (Ray's keeps it until the driver exits).

    Extra keyword arguments go to ``fn`` on every host (or use ``fn_kwargs``).
    Ray's names are accepted: ``accelerator_version``, ``chips_per_vm``,
    ``head_reservation_timeout_s`` (for ``timeout_s``) and
    ``pg_ready_timeout_s``.

    Args:
        fn: The function to run on every host.
        *args: Positional arguments for ``fn``, the same on every host.
        topology: Slice shape (or a Topology/SliceRequest); not with ``tpu_slice``.
        accelerator_type: Generation, e.g. "TPU-V4"; not with ``tpu_slice``.
        tpu_slice: A reservation you hold: run on it, neither reserve nor release.
        slice_index: With ``tpu_slice``, run on that one slice only.
        num_slices: Slices to reserve (default 1).
        chips_per_host: Host layout for v5e/v6e "2x4".
        accelerator_version: Ray's name for ``accelerator_type``.
        chips_per_vm: Ray's name for ``chips_per_host``.
        timeout_s: Longest wait for free slices.
        head_reservation_timeout_s: Ray's name for ``timeout_s``.
        pg_ready_timeout_s: Accepted for Ray parity: groups are ready when reserved.
        init_timeout_s: Deadline for the gang to start (plain functions).
        run_timeout_s: Deadline for ``fn`` (plain functions).
        fn_kwargs: Keyword arguments for ``fn``.
        **kwargs: More keyword arguments for ``fn``.

    Returns:
        Per-host results (plain function) or ObjectRefs (``@ray.remote``).

    Raises:
        InvalidArgument: both or neither of ``tpu_slice`` and ``topology``,
            a released ``tpu_slice``, a bad ``slice_index``.

    Example:
        >>> def psum():
        ...     import jax, jax.numpy as jnp
        ...     return float(jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(
        ...         jnp.ones(jax.local_device_count()))[0])
        >>> run_on_slice(psum, topology="2x2x2", accelerator_type="v4")  # doctest: +SKIP
        [8.0, 8.0]
    """
    check_callable("fn", fn)
    call_kwargs = {**(fn_kwargs or {}), **kwargs}
    if tpu_slice is not None:
        if not isinstance(tpu_slice, SlicePlacementGroup):
            raise fail(
                "tpu_slice", tpu_slice, "a SlicePlacementGroup from rayslice.slice_placement_group", got_type=True
            )
        if topology is not None or accelerator_type is not None or accelerator_version is not None:
            raise fail("topology", topology, "None when tpu_slice is given (the held slice decides)")
        if tpu_slice.released:
            raise fail("tpu_slice", tpu_slice, "a reservation that is still held (this one was released)")
    elif slice_index is not None:
        raise fail("slice_index", slice_index, "None unless tpu_slice is given")
    elif topology is None:
        raise fail("topology", topology, "a slice shape such as '2x2x2' (with accelerator_type), or pass tpu_slice")
    if slice_index is not None:
        check_int("slice_index", slice_index, minimum=0, maximum=tpu_slice.num_slices - 1)  # type: ignore[union-attr]
    if pg_ready_timeout_s is not None:
        check_float("pg_ready_timeout_s", pg_ready_timeout_s, minimum=0)
    if head_reservation_timeout_s is not None:
        timeout_s = head_reservation_timeout_s
    ray_form = _is_ray_remote_function(fn)
    if not ray_form:
        check_float("init_timeout_s", init_timeout_s, minimum=0, exclusive_min=True)
        check_optional(check_float, "run_timeout_s", run_timeout_s, minimum=0, exclusive_min=True)
    held = tpu_slice
    if held is None:
        held = slice_placement_group(
            topology,  # type: ignore[arg-type]  # checked above: not None without tpu_slice
            accelerator_type,
            num_slices=num_slices,
            chips_per_host=chips_per_host,
            accelerator_version=accelerator_version,
            chips_per_vm=chips_per_vm,
            timeout_s=timeout_s,
        )
    try:
        if ray_form:
            refs = _dispatch_tasks(fn, held, slice_index, args, call_kwargs)
            if tpu_slice is None:
                _release_when_done(held, refs)
            return refs
        spg = held if slice_index is None else _one_slice(held, slice_index)
        with SliceGang(spg, init_timeout_s=init_timeout_s) as gang:
            return gang.run(fn, *args, timeout_s=run_timeout_s, **call_kwargs)
    except BaseException:
        if tpu_slice is None:
            held.release()
        raise
    finally:
        if tpu_slice is None and not ray_form:
            held.release()


def _one_slice(spg: SlicePlacementGroup, slice_index: int) -> SlicePlacementGroup:
    """A view of one slice of a held reservation (not released by whoever uses it)."""
    s = spg.slices[slice_index]
    request = dataclasses.replace(spg.request, num_slices=1)
    return SlicePlacementGroup._held(request, (dataclasses.replace(s, slice_index=0),), spg.name, spg.wait_s)


def _dispatch_tasks(
    fn: Any, spg: SlicePlacementGroup, slice_index: int | None, args: tuple, kwargs: dict[str, Any]
) -> list[Any]:
    refs = []
    for s, h in spg.hosts():
        if slice_index is not None and s.slice_index != slice_index:
            continue
        refs.append(
            fn.options(
                num_cpus=0,
                resources={"TPU": float(spg.topology.chips_per_host)},
                scheduling_strategy=spg.scheduling_strategy(s.slice_index, h.worker_id),
            ).remote(*args, **kwargs)
        )
    return refs


def _release_when_done(spg: SlicePlacementGroup, refs: list[Any]) -> None:
    """Releases a reservation made for Ray-form tasks once they have all finished (a daemon thread)."""
    import ray

    def wait_then_release() -> None:
        try:
            ray.wait(refs, num_returns=len(refs), fetch_local=False)
        except Exception:  # the driver is shutting down; its groups go with it
            pass
        finally:
            spg.release()

    threading.Thread(target=wait_then_release, name="rayslice-release", daemon=True).start()
