"""Placement groups for a plan: create one per chosen slice, remove, ask the autoscaler (private).

Serves :mod:`rayslice.placement` only: bundle *i* of a slice's group is pinned
by label selector to that slice's worker *i*, bundle 0 also takes the slice's
``TPU-<pod type>-head`` resource so that Ray's own TPU helpers see the slice as
taken.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from rayslice.cluster import LABEL_SLICE, LABEL_WORKER_ID
from rayslice.planning import Plan
from rayslice.topology import Topology

logger = logging.getLogger(__name__)

PG_NAME_PREFIX = "rayslice:"


def remove_groups(groups: list[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone
            logger.debug("removing placement group %s failed", pg.id, exc_info=True)


def create_groups(
    p: Plan, selectors: list[dict[str, str]], name: str, options: Mapping[str, Any], created: list[Any]
) -> None:
    from ray.util.placement_group import placement_group

    per_slice = p.request.hosts_per_slice
    for index, s in enumerate(p.chosen):
        bundles, labels = [], []
        for worker_id in range(per_slice):
            b = p.request.bundle_resources
            if worker_id == 0:
                b[p.topology.head_resource] = 1.0
            bundles.append(b)
            # The slice/worker labels take precedence over the user's extra ones.
            extra = selectors[index * per_slice + worker_id]
            labels.append({**extra, LABEL_SLICE: s.name, LABEL_WORKER_ID: str(worker_id)})
        created.append(
            placement_group(
                bundles,
                # Unique: the control plane refuses a second group of the same
                # name, and two reservations may race for one slice.
                name=f"{PG_NAME_PREFIX}{name}:{s.name}:{uuid.uuid4().hex[:6]}",
                bundle_label_selector=labels,
                **options,
            )
        )


def request_capacity(topo: Topology, num_slices: int) -> None:
    """Asks the autoscaler for slices the way it understands TPU demand."""
    from ray.autoscaler.sdk import request_resources

    # A TPU-<pod type>-head demand makes Ray's autoscaler (and KubeRay's) scale a
    # multi-host worker group by one whole slice per head.
    request_resources(bundles=[{topo.head_resource: 1}] * num_slices)
