"""Rich tables for the CLI and the demo (private)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from rayslice.cluster import SliceInfo
from rayslice.topology import Topology, generation, valid_topologies

_STATE_STYLE = {"free": "green", "busy": "yellow", "incomplete": "red", "unknown": "red", "dead": "red"}


def slices_table(slices: Sequence[SliceInfo], title: str = "TPU slices") -> Table:
    """One row per host, grouped by slice: state, worker id, node, IP, chips free/total."""
    t = Table(title=title, title_justify="left")
    for col in ("slice", "type / topology", "state", "hosts", "worker", "node", "ip", "chips free"):
        t.add_column(col, no_wrap=True)
    for s in slices:
        style = _STATE_STYLE.get(s.state, "")
        first = [s.name, f"{s.accelerator_type} {s.topology}", f"[{style}]{s.state}[/{style}]",
                 f"{s.hosts_alive}/{s.hosts_expected}"]
        rows = [[str(h.worker_id), h.node_id[:8], h.ip,
                 f"{h.chips_free:g}/{h.chips_total:g}" if h.alive else "[red]dead[/red]"] for h in s.hosts]
        rows += [[str(w), "-", "-", "[red]missing[/red]"] for w in s.missing_workers]
        for i, row in enumerate(rows or [["-", "-", "-", "-"]]):
            t.add_row(*(first if i == 0 else [""] * 4), *row, end_section=i == len(rows) - 1)
    if not slices:
        t.add_row("(none)", *[""] * 7)
    return t


def reservations_table(groups: Sequence[dict[str, Any]], waiting: Sequence[dict[str, Any]]) -> Table:
    """Held rayslice placement groups and reservations still waiting."""
    t = Table(title="Reservations", title_justify="left")
    for col in ("name", "slice", "state", "detail"):
        t.add_column(col)
    for g in groups:
        t.add_row(g["name"], g["slice"], f"[green]{g['state'].lower()}[/green]", f"{g['bundles']} host bundle(s)")
    for w in waiting:
        first = w.get("report", "").splitlines()[1:2]
        t.add_row(w["name"], "-", "[yellow]waiting[/yellow]",
                  f"{w['request']}, waited {w.get('since_s', 0):.0f} s" + (f"\n{first[0].strip()}" if first else ""))
    if not groups and not waiting:
        t.add_row("(none)", "", "", "")
    return t


def topology_table(topo: Topology) -> Table:
    """Facts of one topology, as the catalog knows them."""
    t = Table(title=f"{topo.generation} {topo.name}", title_justify="left", show_header=False)
    t.add_column("fact", style="bold")
    t.add_column("value")
    rows = [
        ("accelerator type (Ray)", topo.accelerator_type),
        ("chips", str(topo.num_chips)),
        ("hosts (TPU VMs = Ray nodes)", str(topo.num_hosts)),
        ("chips per host", str(topo.chips_per_host)),
        ("JAX devices per host", str(topo.devices_per_host)),
        ("host grid", "x".join(map(str, topo.host_grid))),
        ("pod type (ray.io/tpu-pod-type)", topo.pod_type),
        ("TPU_ACCELERATOR_TYPE", topo.api_accelerator_type),
        ("head resource", topo.head_resource),
        ("cloud.google.com/gke-tpu-accelerator", topo.gke_accelerator),
        ("cloud.google.com/gke-tpu-topology", topo.name),
        ("GKE machine type", topo.gke_machine_type),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def shapes_table(gen: str) -> Table:
    """Every valid shape of a generation with its default host layout."""
    g = generation(gen)
    t = Table(title=f"{g.name} ({g.accelerator_type}) topologies", title_justify="left")
    for col in ("topology", "chips", "hosts", "chips/host", "pod type"):
        t.add_column(col)
    for name in valid_topologies(g.name):
        topo = Topology.parse(g.name, name)
        t.add_row(name, str(topo.num_chips), str(topo.num_hosts), str(topo.chips_per_host), topo.pod_type)
    return t
