"""The ``rayslice`` command: topology, status, explain, sim, demo.

Errors a user can fix are printed as one line (``error: ...``) with exit code
1, never as a stack trace.

Example:
    $ rayslice topology v6e 4x4
    $ rayslice sim up --slice v4:2x2x2 --slice v4:2x2x2 --detach
    $ rayslice status
    $ rayslice sim down
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from rayslice._deadline import Deadline
from rayslice.errors import RaysliceError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Run JAX workloads on whole accelerator slices with Ray.")
sim_app = typer.Typer(no_args_is_help=True, help="A simulated TPU cluster on this machine.")
app.add_typer(sim_app, name="sim")
console = Console()
err = Console(stderr=True)


def _home() -> Path:
    return Path(os.environ.get("RAYSLICE_HOME", Path.home() / ".rayslice"))


def _state_file() -> Path:
    return _home() / "sim.json"


def _read_state() -> dict[str, Any] | None:
    try:
        return json.loads(_state_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _connected(address: str | None) -> Iterator[str]:
    """Connects ``ray`` to the given cluster, the running simulator, or RAY_ADDRESS; disconnects after."""
    import ray

    state = _read_state()
    if address is None and state and _pid_alive(state["pid"]):
        address = state["address"]
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise RaysliceError("no cluster to connect to: pass --address, set RAY_ADDRESS, or run `rayslice sim up`")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as e:
        raise RaysliceError(f"cannot connect to Ray at {address}: {e}") from None
    try:
        yield address
    finally:
        ray.shutdown()


@app.command()
def topology(
    accelerator: Annotated[str, typer.Argument(help="Generation in any spelling: v6e, TPU-V4, tpu-v5-lite-podslice ...")],
    shape: Annotated[str | None, typer.Argument(help="Topology, e.g. 4x4. Omit to list valid shapes.")] = None,
    chips_per_host: Annotated[int | None, typer.Option(help="Host layout for shapes that have two (v5e/v6e 2x4).")] = None,
) -> None:
    """Facts of a TPU topology, or the valid shapes of a generation."""
    from rayslice._tables import shapes_table, topology_table
    from rayslice.topology import Topology

    if shape is None:
        console.print(shapes_table(accelerator))
    else:
        console.print(topology_table(Topology.parse(accelerator, shape, chips_per_host=chips_per_host)))


@app.command()
def status(address: Annotated[str | None, typer.Option(help="Ray address (default: the running simulator).")] = None) -> None:
    """Slices of the cluster and their state, and rayslice reservations."""
    import ray

    from rayslice._tables import reservations_table, slices_table
    from rayslice.cluster import list_slices
    from rayslice.placement import PG_NAME_PREFIX, waiting_reservations

    with _connected(address) as addr:
        console.print(f"cluster: {addr}")
        console.print(slices_table(list_slices()))
        groups = []
        for pg in ray.util.placement_group_table().values():
            if pg.get("name", "").startswith(PG_NAME_PREFIX) and pg["state"] in ("CREATED", "PENDING", "RESCHEDULING"):
                _, job, slice_name = pg["name"].split(":")[:3]
                groups.append({"name": job, "slice": slice_name, "state": pg["state"], "bundles": len(pg["bundles"])})
        console.print(reservations_table(groups, waiting_reservations()))


@app.command()
def explain(
    shape: Annotated[str, typer.Argument(help="Topology, e.g. 2x2x2.")],
    accelerator: Annotated[str, typer.Argument(help="Generation, e.g. TPU-V4.")],
    num_slices: int = 1,
    chips_per_host: int | None = None,
    address: str | None = None,
) -> None:
    """Why each slice could or could not take a reservation right now."""
    from rayslice.placement import explain as explain_plan

    with _connected(address):
        console.print(explain_plan(shape, accelerator, num_slices=num_slices, chips_per_host=chips_per_host).explain())


@sim_app.command("up")
def sim_up(
    slice_: Annotated[list[str], typer.Option("--slice", help="GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME], repeatable.")],
    detach: Annotated[bool, typer.Option(help="Start in the background and return.")] = False,
    head_cpus: int = 2,
    dashboard: Annotated[bool, typer.Option(help="Start Ray's dashboard.")] = False,
    timeout_s: Annotated[float, typer.Option(help="Deadline for a detached start.")] = 180.0,
) -> None:
    """Start a simulated TPU cluster and print the address to connect to."""
    from rayslice.sim import SliceSpec

    specs = [SliceSpec.parse(s) for s in slice_]  # validate before starting anything
    state = _read_state()
    if state and _pid_alive(state["pid"]):
        raise RaysliceError(f"a simulated cluster is already running (pid {state['pid']}, {state['address']}); "
                            "run `rayslice sim down` first")
    if detach:
        _detach(slice_, head_cpus, dashboard, timeout_s)
        return
    _run_foreground(specs, head_cpus, dashboard)


def _detach(slices: list[str], head_cpus: int, dashboard: bool, timeout_s: float) -> None:
    _home().mkdir(parents=True, exist_ok=True)
    _state_file().unlink(missing_ok=True)
    log = _home() / "sim.log"
    cmd = [sys.executable, "-m", "rayslice.cli", "sim", "up", f"--head-cpus={head_cpus}"]
    cmd += ["--dashboard"] if dashboard else []
    for s in slices:
        cmd += ["--slice", s]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = Deadline(timeout_s)
    with err.status("starting simulated cluster in the background"):
        while True:
            state = _read_state()
            if state and state.get("pid") == proc.pid:
                break
            if proc.poll() is not None:
                tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise RaysliceError(f"simulator exited with code {proc.returncode}: {tail[0]} (log: {log})")
            if deadline.expired:
                proc.terminate()
                raise RaysliceError(f"simulator not up within {timeout_s:g} s (log: {log})")
            time.sleep(0.2)
    console.print(state["summary"])
    console.print(f"address: [bold]{state['address']}[/bold]  (pid {proc.pid}; stop with `rayslice sim down`)")


def _run_foreground(specs: list, head_cpus: int, dashboard: bool) -> None:
    from rayslice._tables import slices_table
    from rayslice.cluster import list_slices
    from rayslice.sim import SimulatedCluster

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    sim = SimulatedCluster(specs, head_cpus=head_cpus, include_dashboard=dashboard)
    with err.status(f"starting {sum(s.topology_info.num_hosts for s in specs)} simulated host(s)"):
        sim.start()
    try:
        summary = f"{sim.num_hosts} hosts up in {sim.startup_s:.1f} s"
        console.print(slices_table(list_slices()))
        console.print(summary)
        console.print(f"address: [bold]{sim.address}[/bold]  (Ctrl-C or `rayslice sim down` to stop)")
        _home().mkdir(parents=True, exist_ok=True)
        tmp = _state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "address": sim.address, "summary": summary,
                                   "dashboard": sim.dashboard_url}))
        tmp.replace(_state_file())  # atomic: a reader never sees half a file
        while not stop.wait(0.5):
            pass
    finally:
        with err.status("stopping simulated cluster"):
            sim.shutdown()
        state = _read_state()
        if state and state.get("pid") == os.getpid():
            _state_file().unlink(missing_ok=True)
        console.print("simulated cluster stopped")


@sim_app.command("down")
def sim_down(timeout_s: float = 60.0) -> None:
    """Stop the simulated cluster started by `rayslice sim up`."""
    state = _read_state()
    if not state or not _pid_alive(state["pid"]):
        _state_file().unlink(missing_ok=True)
        raise RaysliceError(f"no simulated cluster is running (state file: {_state_file()})")
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = Deadline(timeout_s)
    with err.status(f"stopping simulated cluster (pid {pid})"):
        while _pid_alive(pid) and not deadline.expired:
            time.sleep(0.2)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        err.print(f"[yellow]simulator did not stop within {timeout_s:g} s; killed pid {pid}[/yellow]")
    _state_file().unlink(missing_ok=True)
    console.print("simulated cluster stopped")


@app.command()
def profile(
    name: Annotated[str, typer.Argument(help="Training run name or serve deployment name.")],
    seconds: Annotated[float, typer.Option(help="Trace length.")] = 5.0,
    output: Annotated[str | None, typer.Option(help="Root directory (default: the run's profiles/).")] = None,
    address: str | None = None,
) -> None:
    """Capture a JAX trace on every host of a running job at once."""
    from rayslice.profiler import capture

    with _connected(address), err.status(f"tracing every host of {name} for {seconds:g} s"):
        files = capture(name, seconds=seconds, output_dir=output)
    for host, paths in files.items():
        traces = [p for p in paths if p.endswith((".xplane.pb", ".trace.json.gz"))]
        console.print(f"{host}: {len(paths)} file(s)" + (f", e.g. {traces[0]}" if traces else ""))


@app.command()
def k8s(
    kind: Annotated[str, typer.Argument(help="raycluster, rayjob or rayservice.")],
    accelerator: Annotated[str, typer.Option(help="Generation, e.g. v6e, TPU-V4.")],
    topology: Annotated[str, typer.Option(help="Slice shape, e.g. 4x4.")],
    image: Annotated[str, typer.Option(help="Container image with rayslice (see docker/).")],
    slices: Annotated[int, typer.Option(help="Slices (worker group replicas).")] = 1,
    name: Annotated[str, typer.Option(help="Resource name (DNS-1035 label).")] = "rayslice",
    entrypoint: Annotated[str | None, typer.Option(help="Job command (rayjob).")] = None,
    chips_per_host: int | None = None,
    autoscale: Annotated[bool, typer.Option(help="Start at 0 slices; the autoscaler adds whole slices.")] = False,
    namespace: str | None = None,
    check: Annotated[bool, typer.Option(help="Validate against the KubeRay CRDs when they can be found.")] = True,
) -> None:
    """Print a KubeRay manifest for GKE TPU node pools."""
    from rayslice.k8s import ClusterSpec, find_crd_dir, manifest, to_yaml, validate

    spec = ClusterSpec(accelerator, topology, image=image, num_slices=slices, name=name, entrypoint=entrypoint,
                       chips_per_host=chips_per_host, enable_autoscaling=autoscale, namespace=namespace)
    doc = manifest(kind, spec)
    if check:
        try:
            crds = find_crd_dir()
        except FileNotFoundError:
            err.print("[yellow]note: KubeRay CRDs not found; manifest not validated[/yellow]")
        else:
            validate(doc, crds)
    console.print(to_yaml(doc), end="", markup=False, highlight=False, soft_wrap=True)


@app.command()
def demo() -> None:
    """Walk through rayslice on an embedded simulated cluster."""
    from rayslice.demo import run_demo

    run_demo(console)


def main() -> None:
    """Entry point: runs the app, turning expected errors into one-line messages."""
    try:
        app()
    except (RaysliceError, ValueError, TimeoutError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        err.print(f"[red]error:[/red] {first}", highlight=False, soft_wrap=True)
        rest = str(e).splitlines()[1:]
        if rest:
            err.print("\n".join(rest), highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]")
        sys.exit(130)


if __name__ == "__main__":
    main()
