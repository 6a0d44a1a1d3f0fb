"""Rich tables and consoles for the CLI and the demo (private).

Output stays readable when it is piped or logged (``rayslice demo > log``, CI
logs): :func:`make_console` gives such output at least 120 columns and never
hard-wraps plain lines, and the tables keep slice names and states whole in a
narrow terminal (other columns fold instead).

>>> import io
>>> from rayslice.topology import Topology
>>> out = io.StringIO()
>>> make_console(file=out).print(topology_table(Topology.parse("v6e", "4x4")))
>>> "ct6e-standard-4t" in out.getvalue()
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from rayslice.cluster import SliceInfo
from rayslice.topology import Topology, generation, valid_topologies

_STATE_STYLE = {"free": "green", "busy": "yellow", "incomplete": "red", "unknown": "red", "dead": "red"}
#: Width of output that is not a terminal (a pipe, a file, a CI log), at least.
LOG_WIDTH = 120


def make_console(*, stderr: bool = False, file: IO[str] | None = None, min_width: int = LOG_WIDTH) -> Console:
    """A rich Console for rayslice's output.

    On a terminal it is rich's usual console. Otherwise (a pipe, a file, a CI
    log, where rich would assume 80 columns) it is at least ``min_width``
    columns wide (more if ``$COLUMNS`` says so) and prints plain lines without
    hard wrapping them, so tables, names and states stay whole and lines stay
    greppable.

    >>> import io
    >>> make_console(file=io.StringIO()).width
    120
    """
    console = Console(stderr=stderr, file=file)
    if not console.is_terminal:
        console = Console(stderr=stderr, file=file, width=max(min_width, console.width), soft_wrap=True)
    return console


def _keep_whole(values: Sequence[str], header: str) -> dict[str, Any]:
    """Column options that never cut these values (names, states) in a narrow console."""
    return {"no_wrap": True, "min_width": max([len(header), *map(len, values)])}


def slices_table(slices: Sequence[SliceInfo], title: str = "TPU slices") -> Table:
    """One row per host, grouped by slice: state, worker id, node, IP, chips free/total.

    Slice names and states are never cut; when the console is narrow the other
    columns fold onto more lines.
    """
    t = Table(title=title, title_justify="left")
    t.add_column("slice", **_keep_whole([s.name for s in slices], "slice"))
    t.add_column("type / topology", overflow="fold")
    t.add_column("state", **_keep_whole([s.state for s in slices], "state"))
    for col in ("hosts", "worker", "node", "ip", "chips free"):
        t.add_column(col, overflow="fold")
    for s in slices:
        style = _STATE_STYLE.get(s.state, "")
        first = [
            s.name,
            f"{s.accelerator_type} {s.topology}",
            f"[{style}]{s.state}[/{style}]",
            f"{s.hosts_alive}/{s.hosts_expected}",
        ]
        rows = [
            [
                str(h.worker_id),
                h.node_id[:8],
                h.ip,
                f"{h.chips_free:g}/{h.chips_total:g}" if h.alive else "[red]dead[/red]",
            ]
            for h in s.hosts
        ]
        rows += [[str(w), "-", "-", "[red]missing[/red]"] for w in s.missing_workers]
        for i, row in enumerate(rows or [["-", "-", "-", "-"]]):
            t.add_row(*(first if i == 0 else [""] * 4), *row, end_section=i == len(rows) - 1)
    if not slices:
        t.add_row("(none)", *[""] * 7)
    return t


def reservations_table(groups: Sequence[dict[str, Any]], waiting: Sequence[dict[str, Any]]) -> Table:
    """Held rayslice placement groups and reservations still waiting."""
    t = Table(title="Reservations", title_justify="left")
    t.add_column("name", overflow="fold")
    t.add_column("slice", **_keep_whole([g["slice"] for g in groups], "slice"))
    t.add_column("state", **_keep_whole([g["state"] for g in groups] + ["waiting"], "state"))
    t.add_column("detail")
    for g in groups:
        t.add_row(g["name"], g["slice"], f"[green]{g['state'].lower()}[/green]", f"{g['bundles']} host bundle(s)")
    for w in waiting:
        first = w.get("report", "").splitlines()[1:2]
        t.add_row(
            w["name"],
            "-",
            "[yellow]waiting[/yellow]",
            f"{w['request']}, waited {w.get('since_s', 0):.0f} s" + (f"\n{first[0].strip()}" if first else ""),
        )
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
