"""``rayslice demo``: the whole system, step by step, on an embedded simulated cluster.

Each step is a real use of the public API on a real multi-node Ray cluster
running on this machine:

1. bring up two simulated v4 ``2x2x2`` slices (2 hosts x 4 chips each);
2. show the slices as the inventory sees them;
3. start one JAX process on every host, which reports the devices it sees;
4. make one host of slice A busy, reserve a whole slice (it lands on B),
   and run a cross-host ``psum`` on it;
5. show why a reservation of a missing shape fails fast;
6. shut everything down and check that no Ray process is left.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.panel import Panel

from rayslice._tables import slices_table

SLICES = (("v4", "2x2x2", "slice-a"), ("v4", "2x2x2", "slice-b"))


def _host_report() -> dict:
    # Runs inside a gang process on a simulated host.
    import os

    import jax

    from rayslice.gang import host_context

    ctx = host_context()
    return {
        "slice": ctx.slice_name,
        "worker": ctx.worker_id,
        "rank": jax.process_index(),
        "local": jax.local_device_count(),
        "global": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "TPU_WORKER_ID": os.environ["TPU_WORKER_ID"],
    }


def _psum() -> float:
    # Sums 1 over every device of every host of the slice: crosses hosts.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    local = np.ones((jax.local_device_count(),), np.float32) * (jax.process_index() + 1)
    x = jax.make_array_from_process_local_data(sharding, local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    return float(total.addressable_data(0))


def _step(console: Console, n: int, text: str) -> None:
    console.rule(f"[bold]{n}. {text}")


def run_demo(console: Console) -> None:
    """Runs the demo end to end; raises on any failure."""
    import ray

    import rayslice
    from rayslice.sim import SimulatedCluster, SliceSpec

    t_start = time.monotonic()
    specs = [SliceSpec(gen, shape, name=name) for gen, shape, name in SLICES]
    _step(console, 1, "Start a simulated TPU cluster (real multi-node Ray on this machine)")
    sim = SimulatedCluster(specs)
    with console.status(f"starting head + {sum(s.topology_info.num_hosts for s in specs)} simulated hosts"):
        sim.start()
    try:
        console.print(f"{sim.num_hosts} hosts up in {sim.startup_s:.1f} s at {sim.address}")

        _step(console, 2, "Slices as rayslice.list_slices() sees them")
        console.print(slices_table(rayslice.list_slices()))

        _step(console, 3, "One JAX process per host, every host of both slices")
        with console.status("reserving both slices and starting 4 JAX processes"):
            reports = rayslice.run_on_slice(_host_report, topology="2x2x2", accelerator_type="TPU-V4",
                                            num_slices=2, timeout_s=60)
        for r in reports:
            console.print(f"  {r['slice']} worker {r['worker']} (TPU_WORKER_ID={r['TPU_WORKER_ID']}): "
                          f"rank {r['rank']}, {r['local']} local {r['platform']} devices, {r['global']} global")

        _step(console, 4, "Reserve a whole slice while a host of slice-a is busy, then psum across its hosts")
        blocker = ray.util.placement_group(
            [{"TPU": 4}], bundle_label_selector=[{"ray.io/tpu-slice-name": "slice-a", "ray.io/tpu-worker-id": "1"}])
        ray.get(blocker.ready(), timeout=30)
        try:
            console.print(rayslice.explain("2x2x2", "TPU-V4").explain())
            t0 = time.monotonic()
            with rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, name="demo") as spg:
                got = spg.slices[0]
                console.print(f"reserved [bold]{got.name}[/bold] in {1000 * (time.monotonic() - t0):.0f} ms; "
                              f"bundles -> worker ids {[h.worker_id for h in got.hosts]}")
                with rayslice.SliceGang(spg, init_timeout_s=60) as gang:
                    sums = gang.run(_psum, timeout_s=60)
                hosts, devs = spg.topology.num_hosts, spg.topology.devices_per_host
                expected = float(sum((rank + 1) * devs for rank in range(hosts)))
                console.print(f"psum over {hosts} hosts x {devs} devices = {sums} (expected {expected})")
                if any(s != expected for s in sums):
                    raise RuntimeError(f"psum gave {sums}, expected {expected}")
        finally:
            ray.util.remove_placement_group(blocker)

        _step(console, 5, "A shape the cluster does not have fails fast, with the reason")
        t0 = time.monotonic()
        try:
            rayslice.slice_placement_group("4x4", "TPU-V6E", timeout_s=60)
        except rayslice.NoMatchingSlice as e:
            console.print(f"NoMatchingSlice after {time.monotonic() - t0:.2f} s:\n{e}")
    finally:
        _step(console, 6, "Shut down")
        with console.status("stopping the simulated cluster"):
            sim.shutdown()
    console.print(Panel(f"demo finished in {time.monotonic() - t_start:.1f} s; cluster stopped, no processes left",
                        style="green"))
