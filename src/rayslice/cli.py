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

from rayslice._deadline import Deadline
from rayslice._tables import make_console
from rayslice.errors import RaysliceError

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    help="Run JAX workloads on whole accelerator slices with Ray.",
)
sim_app = typer.Typer(no_args_is_help=True, help="A simulated TPU cluster on this machine.")
app.add_typer(sim_app, name="sim")
# Not cut to 80 columns when piped or logged (see rayslice._tables.make_console).
console = make_console()
err = make_console(stderr=True)


_CONNECT_TIMEOUT_S = 30.0


def _home() -> Path:
    home = Path(os.environ.get("RAYSLICE_HOME", Path.home() / ".rayslice"))
    if home.exists() and not home.is_dir():
        raise RaysliceError(f"RAYSLICE_HOME={str(home)!r} is not a directory")
    for parent in home.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RaysliceError(f"RAYSLICE_HOME={str(home)!r} is under {str(parent)!r}, which is not a directory")
            break
    return home


def _state_file() -> Path:
    return _home() / "sim.json"


def _read_state() -> dict[str, Any] | None:
    """The running simulator's state, or None when there is none or the file is not one of ours."""
    path = _state_file()
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        err.print(f"[yellow]ignoring unreadable state file {path}: {e}[/yellow]", highlight=False)
        return None
    valid = (
        isinstance(state, dict)
        and type(state.get("pid")) is int
        and state["pid"] > 0
        and isinstance(state.get("address"), str)
        and isinstance(state.get("started"), int | float)
    )
    if not valid:
        err.print(f"[yellow]ignoring state file {path}: not written by `rayslice sim up`[/yellow]", highlight=False)
        return None
    return state


def _process_started(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), or None if there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return None


def _is_our_simulator(state: dict[str, Any]) -> bool:
    """The state file's pid is alive AND is the very process that wrote it (same start time, our command)."""
    import psutil

    started = _process_started(state["pid"])
    if started is None or abs(started - float(state["started"])) > 1.0:
        return False
    try:
        cmdline = " ".join(psutil.Process(state["pid"]).cmdline())
    except psutil.Error:
        return False
    return "rayslice" in cmdline and "sim" in cmdline


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fails fast, in one line, when nothing listens at ``host:port``."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", ray://... : let Ray resolve it
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RaysliceError(f"cannot connect to Ray at {address}: {e.strerror or e}") from None


@contextlib.contextmanager
def _connected(address: str | None) -> Iterator[str]:
    """Connects ``ray`` to the given cluster, the running simulator, or RAY_ADDRESS; disconnects after."""
    import ray

    state = _read_state()
    if address is None and state and _is_our_simulator(state):
        address = state["address"]
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise RaysliceError("no cluster to connect to: pass --address, set RAY_ADDRESS, or run `rayslice sim up`")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _check_reachable(address, timeout_s=5.0)

    # ray.init retries a silent endpoint for a long time: give it a deadline. It
    # runs in the main thread (Ray installs its signal handlers there); a timer
    # ends the command with one line if it has not connected in time.
    def give_up() -> None:
        err.print(
            f"[red]error:[/red] cannot connect to Ray at {address}: no answer within {_CONNECT_TIMEOUT_S:g} s",
            highlight=False,
        )
        os._exit(1)

    watchdog = threading.Timer(_CONNECT_TIMEOUT_S, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        failure = _init_ray(address)
    finally:
        watchdog.cancel()
    if failure is not None:
        raise RaysliceError(f"cannot connect to Ray at {address}: {failure}") from None
    try:
        yield address
    finally:
        ray.shutdown()


def _init_ray(address: str) -> BaseException | None:
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as e:  # reported in one line by the caller
        return e
    return None


def _shape_and_type(first: str, second: str | None) -> tuple[str | None, str]:
    """(topology, accelerator type) from two positional words in either order (told apart by content)."""
    from rayslice.topology import is_shape

    if second is None:
        return (first, "") if is_shape(first) else (None, first)
    return (second, first) if is_shape(second) and not is_shape(first) else (first, second)


@app.command()
def topology(
    first: Annotated[
        str, typer.Argument(metavar="TOPOLOGY", help="Topology, e.g. 4x4 (omit to list a generation's shapes).")
    ],
    second: Annotated[
        str | None,
        typer.Argument(
            metavar="ACCELERATOR_TYPE", help="Generation in any spelling: v6e, TPU-V4, tpu-v5-lite-podslice ..."
        ),
    ] = None,
    chips_per_host: Annotated[
        int | None, typer.Option(help="Host layout for shapes that have two (v5e/v6e 2x4).")
    ] = None,
) -> None:
    """Facts of a TPU topology (`rayslice topology 4x4 v6e`), or a generation's shapes (`rayslice topology v6e`).

    The two words may come in either order: a shape and a generation are told apart by what they are.
    """
    from rayslice._tables import shapes_table, topology_table
    from rayslice.topology import Topology

    shape, accelerator_type = _shape_and_type(first, second)
    if shape is None:
        console.print(shapes_table(accelerator_type))
    elif not accelerator_type:
        raise RaysliceError(f"which generation is {shape!r}? e.g. `rayslice topology {shape} v6e`")
    else:
        console.print(topology_table(Topology.parse(shape, accelerator_type, chips_per_host=chips_per_host)))


@app.command()
def status(
    address: Annotated[str | None, typer.Option(help="Ray address (default: the running simulator).")] = None,
) -> None:
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
    first: Annotated[str, typer.Argument(metavar="TOPOLOGY", help="Topology, e.g. 2x2x2.")],
    second: Annotated[str, typer.Argument(metavar="ACCELERATOR_TYPE", help="Generation, e.g. TPU-V4.")],
    num_slices: int = 1,
    chips_per_host: int | None = None,
    address: str | None = None,
) -> None:
    """Why each slice could or could not take a reservation right now (`rayslice explain 2x2x2 TPU-V4`)."""
    from rayslice.placement import explain as explain_plan
    from rayslice.request import SliceRequest

    shape, accelerator_type = _shape_and_type(first, second)
    request = SliceRequest.parse(
        shape or first, accelerator_type, num_slices=num_slices, chips_per_host=chips_per_host
    )  # validated before connecting
    with _connected(address):
        console.print(explain_plan(request).explain())


@sim_app.command("up")
def sim_up(
    slice_: Annotated[list[str], typer.Option("--slice", help="GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME], repeatable.")],
    detach: Annotated[bool, typer.Option(help="Start in the background and return.")] = False,
    head_cpus: int = 2,
    dashboard: Annotated[bool, typer.Option(help="Start Ray's dashboard.")] = False,
    timeout_s: Annotated[float, typer.Option(help="Deadline for a detached start.")] = 180.0,
    verbose: Annotated[bool, typer.Option(help="Show everything Ray prints (INFO logs, worker logs).")] = False,
) -> None:
    """Start a simulated TPU cluster and print the address to connect to."""
    from rayslice.sim import SliceSpec

    # Validate everything before starting (or spawning) anything.
    specs = [SliceSpec.parse(s) for s in slice_]
    if head_cpus < 1:
        raise RaysliceError(f"--head-cpus={head_cpus} is not valid: expected an integer >= 1")
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise RaysliceError(f"--timeout-s={timeout_s:g} is not valid: expected a finite number > 0")
    state = _read_state()
    if state and _is_our_simulator(state):
        raise RaysliceError(
            f"a simulated cluster is already running (pid {state['pid']}, {state['address']}); "
            "run `rayslice sim down` first"
        )
    if detach:
        _detach(slice_, head_cpus, dashboard, timeout_s, verbose=verbose)
        return
    _run_foreground(specs, head_cpus, dashboard, verbose=verbose)


def _detach(slices: list[str], head_cpus: int, dashboard: bool, timeout_s: float, *, verbose: bool = False) -> None:
    _home().mkdir(parents=True, exist_ok=True)
    _state_file().unlink(missing_ok=True)
    log = _home() / "sim.log"
    cmd = [sys.executable, "-m", "rayslice.cli", "sim", "up", f"--head-cpus={head_cpus}"]
    cmd += ["--dashboard"] if dashboard else []
    cmd += ["--verbose"] if verbose else []
    for s in slices:
        cmd += ["--slice", s]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
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


def _run_foreground(specs: list, head_cpus: int, dashboard: bool, *, verbose: bool = False) -> None:
    from rayslice._tables import slices_table
    from rayslice.cluster import list_slices
    from rayslice.sim import SimulatedCluster

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    sim = SimulatedCluster(specs, head_cpus=head_cpus, include_dashboard=dashboard, verbose=verbose)
    with err.status(f"starting {sum(s.topology_info.num_hosts for s in specs)} simulated host(s)"):
        sim.start()
    try:
        summary = f"{sim.num_hosts} hosts up in {sim.startup_s:.1f} s"
        console.print(slices_table(list_slices()))
        console.print(summary)
        console.print(f"address: [bold]{sim.address}[/bold]  (Ctrl-C or `rayslice sim down` to stop)")
        _home().mkdir(parents=True, exist_ok=True)
        tmp = _state_file().with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "started": _process_started(os.getpid()),
                    "address": sim.address,
                    "summary": summary,
                    "dashboard": sim.dashboard_url,
                }
            )
        )
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
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise RaysliceError(f"--timeout-s={timeout_s:g} is not valid: expected a finite number > 0")
    state = _read_state()
    if not state or not _is_our_simulator(state):
        # Never signal a pid we did not start: a stale file may name someone else's process now.
        _state_file().unlink(missing_ok=True)
        raise RaysliceError(f"no simulated cluster is running (state file: {_state_file()})")
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = Deadline(timeout_s)
    with err.status(f"stopping simulated cluster (pid {pid})"):
        while _is_our_simulator(state) and not deadline.expired:
            time.sleep(0.2)
    if _is_our_simulator(state):
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
    ray_version: Annotated[
        str | None,
        typer.Option(
            help="The image's Ray version (KubeRay's rayVersion). Default: from a rayproject/ray:X.Y.Z tag, "
            "else the pinned Ray."
        ),
    ] = None,
    check: Annotated[
        bool, typer.Option(help="Validate against the KubeRay CRDs shipped with rayslice (or $RAYSLICE_KUBERAY_CRDS).")
    ] = True,
) -> None:
    """Print a KubeRay manifest for GKE TPU node pools."""
    from rayslice.k8s import ClusterSpec, manifest, to_yaml, validate

    spec = ClusterSpec(
        accelerator,
        topology,
        image=image,
        num_slices=slices,
        name=name,
        entrypoint=entrypoint,
        chips_per_host=chips_per_host,
        enable_autoscaling=autoscale,
        namespace=namespace,
        ray_version=ray_version,
    )
    doc = manifest(kind, spec)
    if check:
        validate(doc)
    console.print(to_yaml(doc), end="", markup=False, highlight=False, soft_wrap=True)


@app.command()
def demo(
    verbose: Annotated[
        bool,
        typer.Option(
            help="Also show everything Ray prints (INFO logs, Ray Data progress, worker logs, raylet crash dumps)."
        ),
    ] = False,
) -> None:
    """Walk through rayslice on an embedded simulated cluster."""
    from rayslice.demo import run_demo

    run_demo(console, verbose=verbose)


def main() -> None:
    """Entry point: runs the app, turning expected errors into one-line messages."""
    try:
        app()
    except (RaysliceError, ValueError, TypeError, TimeoutError, OSError) as e:
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
