"""Elastic multi-slice training: sizes, global batch, exactly-once data across resizes, a run on the simulator."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayslice.errors import InvalidArgument
from rayslice.train import CheckpointConfig, ScalingConfig, TrainContext
from rayslice.train.elastic import (
    ElasticEpoch,
    ResizeEvent,
    SizePolicy,
    check_mesh,
    dumps_epochs,
    elastic_sizes,
    grad_accum_steps,
    initial_layout,
    loads_epochs,
    mesh_shape,
    next_epoch,
    num_rows,
    owner,
    remaining,
    resplit,
)

V4 = {"topology": "2x2x2", "accelerator_type": "TPU-V4"}


def _rows(ranges) -> list[int]:
    return [i for s, e in ranges for i in range(s, e)]


# -- sizes, batch, mesh -------------------------------------------------------------
@given(n=st.integers(1, 64), low=st.integers(1, 64), keep=st.booleans())
def test_allowed_sizes_keep_the_global_batch_exactly(n, low, keep):
    low = min(low, n)
    sizes = elastic_sizes(n, low, keep)
    assert sizes[-1] == n and all(low <= k <= n for k in sizes) and list(sizes) == sorted(set(sizes))
    for k in sizes:
        accum = grad_accum_steps(n, k, keep)
        assert accum * k == n if keep else accum == 1  # same global batch: per-host batch x hosts x micro-steps
    if not keep:
        assert sizes == tuple(range(low, n + 1))


@given(sizes=st.sets(st.integers(1, 16), min_size=1), free=st.integers(0, 40), current=st.integers(1, 16))
def test_size_policy_takes_the_most_that_fit_and_grows_only_after_the_interval(sizes, free, current):
    p = SizePolicy(tuple(sorted(sizes)), regrow_every_s=30)
    k = p.choose(free)
    fitting = [s for s in sizes if s <= free]
    assert k == (max(fitting) if fitting else None)
    assert p.grow_to(current, free, since_resize_s=29.9) is None
    target = p.grow_to(current, free, since_resize_s=30)
    if target is not None:
        assert target > current and target in sizes and target <= current + free
    else:
        assert all(s <= current for s in sizes if s <= current + free)


@given(n=st.sampled_from([1, 2, 4, 8]), inner=st.sampled_from([1, 2, 4, 8]), devices=st.sampled_from([4, 8, 16]))
def test_mesh_shrinks_only_its_first_axis(n, inner, devices):
    mesh = {"data": -1, "model": inner}
    if (n * devices) % inner:
        with pytest.raises(InvalidArgument, match="product is"):
            check_mesh(mesh, n, devices, elastic=True)
        return
    if devices % inner:
        with pytest.raises(InvalidArgument, match="'model' spans slices"):
            check_mesh(mesh, n, devices, elastic=True)
        return
    for k in elastic_sizes(n, 1):
        shape = mesh_shape(mesh, n, k, devices)
        assert math.prod(shape.values()) == k * devices and shape["model"] == inner
    assert mesh_shape(None, n, 1, devices) == {"data": devices}


def test_bad_elastic_settings_are_refused_before_anything_is_reserved():
    with pytest.raises(InvalidArgument, match="min_slices=5 .*from 1 to num_slices=4"):
        ScalingConfig(**V4, num_slices=4, min_slices=5)
    with pytest.raises(InvalidArgument, match="min_slices=0"):
        ScalingConfig(**V4, num_slices=4, min_slices=0)
    with pytest.raises(InvalidArgument, match="min_slices=3 .*keep_global_batch=False"):
        ScalingConfig(**V4, num_slices=4, min_slices=3)  # 3 does not divide 4: no smaller size keeps the batch
    with pytest.raises(InvalidArgument, match="regrow_every_s=-1"):
        ScalingConfig(**V4, num_slices=2, min_slices=1, regrow_every_s=-1)
    with pytest.raises(InvalidArgument, match="keep_global_batch=1"):
        ScalingConfig(**V4, num_slices=2, min_slices=1, keep_global_batch=1)
    with pytest.raises(InvalidArgument, match="'model' spans slices"):
        ScalingConfig(**V4, num_slices=2, min_slices=1, mesh={"data": 1, "model": 16})
    with pytest.raises(InvalidArgument, match="mesh=.*product is 16"):
        ScalingConfig(**V4, num_slices=2, mesh={"data": 3})
    sc = ScalingConfig(**V4, num_slices=3, min_slices=2, keep_global_batch=False)
    assert sc.elastic and sc.elastic_sizes == (2, 3)
    plain = ScalingConfig(**V4, num_slices=2)
    assert not plain.elastic and plain.min_slices == 2 and plain.elastic_sizes == (2,)
    assert ScalingConfig(**V4, num_slices=2, min_slices=1, mesh={"data": -1, "model": 4}).mesh == {
        "data": 4,
        "model": 4,
    }


def test_train_context_reports_the_world_of_this_size():
    ctx = TrainContext(1, 2, 0, 1, 1, 2, 4, "r", "/r", 3, max_slices=4, elastic_epoch=2, grad_accum_steps=4)
    assert ctx.elastic and ctx.world_device_count == 8 and ctx.mesh_shape == {"data": 8}
    plain = TrainContext(0, 2, 0, 1, 0, 2, 4, "r", "/r", 1)
    assert (plain.max_slices, plain.elastic_epoch, plain.grad_accum_steps, plain.elastic) == (1, 0, 1, False)


# -- exactly-once data --------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 300),
    world=st.integers(1, 8),
    resizes=st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=8, max_size=8), st.integers(1, 8)), max_size=6),
)
def test_every_row_of_the_epoch_is_consumed_exactly_once_whatever_the_resizes(rows, world, resizes):
    layout = initial_layout(rows, world)
    epoch_rows = sorted(_rows(r for host in layout for r in host))
    assert len(epoch_rows) == rows - rows % world  # as Dataset.split(equal=True): < world rows dropped
    consumed: list[int] = []
    for fractions, new_world in resizes:
        # Each host has read some prefix of its shard when the checkpoint is taken.
        positions = [int(f * num_rows(host)) for f, host in zip(fractions, layout)]
        for host, pos in zip(layout, positions):
            consumed.extend(_rows(host)[:pos])
        layout = resplit(layout, positions, new_world)
        sizes = [num_rows(h) for h in layout]
        assert len(layout) == new_world and max(sizes) - min(sizes) <= 1
    for host in layout:  # the last world reads to the end
        consumed.extend(_rows(host))
    assert sorted(consumed) == epoch_rows


@given(ranges=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 10)), max_size=6), k=st.integers(0, 80))
def test_remaining_drops_exactly_the_first_rows(ranges, k):
    hosts, at = [], 0
    for gap, n in ranges:
        hosts.append((at + gap, at + gap + n))
        at += gap + n
    assert _rows(remaining(tuple(hosts), k)) == _rows(hosts)[k:]


def test_an_epoch_goes_on_while_its_split_holds_and_a_new_one_splits_what_is_left():
    e0 = ElasticEpoch(0, 0, 2, 4, {"train": initial_layout(32, 4)})
    pos = {0: [4, 4, 4, 4]}
    positions = lambda name, ep: pos[ep.index]
    # A restart on the same world from its own checkpoint keeps the epoch (and its saved positions).
    assert next_epoch([e0], 6, 2, 4, positions) is e0
    # A shrink at step 6: a new epoch, holding exactly the 16 rows not yet read.
    e1 = next_epoch([e0], 6, 1, 2, positions)
    assert (e1.index, e1.start_step, e1.world_size) == (1, 6, 2)
    assert sorted(_rows(r for h in e1.layouts["train"] for r in h)) == [i for i in range(32) if i % 8 >= 4]
    # Lost again before its first checkpoint, restarted on the same size: the same split (from step 6 again).
    assert next_epoch([e0, e1], 6, 1, 2, positions) is e1
    # Grown back from its own checkpoint 9: split again, from e1's positions.
    pos[1] = [2, 8]
    e2 = next_epoch([e0, e1], 9, 2, 4, positions)
    assert owner([e0, e1, e2], 9) is e1 and owner([e0, e1, e2], 6) is e0 and owner([e0, e1, e2], None) is e0
    assert num_rows(tuple(r for h in e2.layouts["train"] for r in h)) == 16 - 10
    assert loads_epochs(dumps_epochs([e0, e1, e2])) == [e0, e1, e2]
    # Unknown positions (no iterator state saved): the rows are split again from their start, none lost.
    e1b = next_epoch([e0], 6, 1, 2, lambda n, e: None)
    assert sorted(_rows(r for h in e1b.layouts["train"] for r in h)) == list(range(32))


def test_a_checkpoint_of_the_old_split_gives_no_data_position_after_a_resize(tmp_path):
    from rayslice.train import Checkpoint
    from rayslice.train import context as _context

    step = tmp_path / "6" / ".rayslice"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 6, "world_size": 4, "data_states": {"data": [{}] * 4}}))
    ckpt = Checkpoint(str(tmp_path / "6"))
    base = TrainContext(1, 2, 0, 1, 1, 2, 4, "r", "/r", 2, max_slices=2)
    try:
        _context._set_current(TrainContext(**{**base.__dict__, "elastic_epoch": 1, "data_resplit_step": 6}))
        assert ckpt.data_state("data") is None  # the new shard starts at its first row
        _context._set_current(base)
        with pytest.raises(ValueError, match="world size changed"):
            ckpt.data_state("data")
    finally:
        _context._set_current(None)


def test_a_resize_reads_as_one_line():
    e = ResizeEvent(3.0, 12, 2, 1, "lost", 1.5, 1)
    assert str(e) == "2 -> 1 slices at 3.0 s (lost; step 12, 1.50 s lost)"
    assert "s lost" not in str(ResizeEvent(3.0, 12, 1, 2, "grow"))


def test_resizes_are_events_in_the_goodput():
    from rayslice.train.goodput import AttemptEnd, GoodputTracker

    ticks = iter([0.0, 30.0])
    g = GoodputTracker(clock=lambda: next(ticks))
    for outcome in ("preempted", "ok"):
        g.begin_attempt()
        g.add("productive", 10.0)
        g.end_attempt(AttemptEnd(len(g.attempts), outcome, "lost" if outcome != "ok" else ""))
    events = [ResizeEvent(12.5, 40, 3, 2, "lost", 2.25, 1), ResizeEvent(20.0, 55, 2, 3, "grow", 1.0, 2)]
    g.resizes = list(events)
    out = g.finish()
    assert out.resizes == tuple(events)
    line = out.recovery_line()
    assert line.endswith("; resizes: " + ", ".join(str(e) for e in events))
    assert out.table().caption == line
    d = out.as_dict()["resizes"]
    assert [(e["slices_before"], e["slices_after"], e["reason"], e["lost_s"]) for e in d] == [
        (3, 2, "lost", 2.25),
        (2, 3, "grow", 1.0),
    ]
    assert "resizes" not in GoodputTracker().finish().recovery_line()


# -- on the simulator ----------------------------------------------------------------
def _hold_for_the_next_stop(timeout_s: float) -> None:
    """In a gang process: waits until the run is about to stop (a grow or preemption notice
    announced; the next report saves and stops) or this process is ended, at most ``timeout_s``.

    Lets a test wait on the event it is about (a grow, a loss) instead of budgeting steps for it:
    a slow machine otherwise reads every row before the event comes.
    """
    import time

    from rayslice.train import worker

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = worker._SESSION
        if s is not None and s.agreement is not None and s.agreement.notice is not None:
            return
        time.sleep(0.05)


def elastic_loop(config: dict) -> None:
    """Reads row ids with get_dataset_shard + iter_jax_batches; ``grad_accum_steps`` micro-batches per step.

    ``config["hold"]``: ``[slices, elastic epoch]`` pairs: in a world of that size and epoch, after
    each report, the loop waits for the run's next stop (:func:`_hold_for_the_next_stop`, 90 s at most).
    """
    import json
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.data import iter_jax_batches
    from rayslice.train import get_checkpoint, get_context, get_dataset_shard, report

    ctx = get_context()
    mesh = jax.make_mesh(tuple(ctx.mesh_shape.values()), tuple(ctx.mesh_shape))
    sharding = NamedSharding(mesh, P("data"))
    total = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    # Sharded over "data": 8 or 4 ways by size, so a restore onto another size reshards it.
    vec = jax.device_put(jnp.arange(8, dtype=jnp.float32), sharding)
    ckpt, data_state, step = get_checkpoint(), None, 0
    if ckpt is not None:
        back = ckpt.restore({"total": total, "vec": vec})
        total, vec = back["total"], back["vec"]
        data_state, step = ckpt.data_state("train"), ckpt.step
    it = iter_jax_batches(
        get_dataset_shard("train"),
        batch_size=config["batch"],
        state=data_state,
        ragged="pad",
        pad_value=-1,
        columns=["id"],
        sharding=sharding,
    )
    add = jax.jit(lambda t, ids: t + jnp.sum(jnp.where(ids >= 0, ids, 0)), out_shardings=NamedSharding(mesh, P()))
    bump = jax.jit(lambda v: v + 1, out_shardings=sharding)
    done = False
    while not done:
        mine: list[int] = []
        micro = 0
        for _ in range(ctx.grad_accum_steps):  # the global batch stays that of the full-size run
            try:
                batch = next(it)["id"]
            except StopIteration:
                done = True
                break
            micro += 1
            for shard in batch.addressable_shards:
                mine.extend(int(i) for i in np.asarray(shard.data) if i >= 0)
            total = add(total, batch)
        if not micro:
            break
        step += 1
        vec = bump(vec)
        with open(f"{config['ids_dir']}/{step}-{ctx.attempt}-{ctx.world_rank}.json", "w") as f:
            json.dump(sorted(set(mine)), f)  # what this host read in this step (the driver may never hear of it)
        time.sleep(config["sleep_s"])
        metrics = {
            "step": step,
            "ids": sorted(set(mine)),
            "slices": ctx.num_slices,
            "accum": ctx.grad_accum_steps,
            "epoch": ctx.elastic_epoch,
            "megascale": os.environ.get("MEGASCALE_NUM_SLICES", ""),
            "total": total,
            "vec": multihost_utils.process_allgather(vec, tiled=True).tolist(),  # every host's part
            "mesh": dict(ctx.mesh_shape),
            "pid": os.getpid(),
        }
        report(metrics, checkpoint={"total": total, "vec": vec, "train": it})
        if [ctx.num_slices, ctx.elastic_epoch] in config.get("hold", []):
            _hold_for_the_next_stop(90)


def _two_slices_on_ram(name, tmp_path, rows, sleep_s, callback, failure_config, hold=()):
    """A trainer of :func:`elastic_loop` on 2 v4 2x2x1 slices (at least 1), the RAM tier every step."""
    import ray

    from rayslice.train import JaxTrainer, RunConfig

    return JaxTrainer(
        elastic_loop,
        train_loop_config={
            "batch": 4,
            "sleep_s": sleep_s,
            "ids_dir": str(tmp_path / "ids"),
            "hold": [list(h) for h in hold],
        },
        scaling_config=ScalingConfig(
            topology="2x2x1",
            accelerator_type="TPU-V4",
            num_slices=2,
            min_slices=1,
            regrow_every_s=0,
            reservation_timeout_s=60,
        ),
        datasets={"train": ray.data.range(rows)},
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path),
            progress=False,
            callbacks=[callback],
            failure_config=failure_config,
            checkpoint_config=CheckpointConfig(ram_every_steps=1, storage_every_steps=1000),
        ),
    )


@pytest.mark.ray
def test_a_run_shrinks_onto_the_survivors_then_grows_back_reading_every_row_once(ray_cluster, tmp_path):

    from rayslice.train import FailureConfig, UserCallback

    from .conftest import live_groups
    from .test_train import _no_actors_left

    names = [ray_cluster.add_slice(f"v4:2x2x1@elastic-{x}") for x in "ab"]
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    rows = 8 * 40  # 2 hosts x 4 rows per step: 40 steps at full size
    by_step: dict[int, dict] = {}
    events: list[str] = []

    class Chaos(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            m = metrics[0]
            by_step[m["step"]] = {**m, "ids": sorted(i for r in metrics for i in r["ids"])}
            if m["slices"] == 2 and m["step"] >= 3 and not events:
                events.append("kill")
                ray_cluster.preempt_slice(names[1])  # no spare slice: the run must go on with one
            elif m["slices"] == 1 and events == ["kill"]:
                events.append("add")
                names.append(ray_cluster.add_slice("v4:2x2x1@elastic-c"))  # a node pool brings one back

    try:
        # The RAM tier every step (storage only for the grow's save): the shrink restores from RAM onto the
        # smaller world, slice b's rank from its replica on slice a.
        # On one slice (epoch 1) each step waits for the grow's notice: the grow comes however slow the day.
        result = _two_slices_on_ram(
            "elastic", tmp_path, rows, 0.3, Chaos(), FailureConfig(max_preemptions=2), hold=[(1, 1)]
        ).fit()
        assert result.error is None, result.error
        assert [(e.slices_before, e.slices_after, e.reason) for e in result.resizes] == [(2, 1, "lost"), (1, 2, "grow")]
        shrink = result.restores[0]
        assert shrink.tier == "ram" and "saved by 2 hosts, restored onto 1" in shrink.reason, shrink
        assert result.metrics["vec"] == [float(i + result.metrics["step"]) for i in range(8)]  # resharded, bitwise
        assert all(e.lost_s is not None and e.lost_s >= 0 for e in result.resizes)
        assert result.preemptions == 1 and result.attempts == 3
        # What every host read, step by step, in the attempt whose step counts (the last one that ran it).
        latest: dict[int, int] = {}
        for p in ids_dir.iterdir():
            step, attempt, _ = map(int, p.stem.split("-"))
            latest[step] = max(latest.get(step, 0), attempt)
        steps = sorted(latest)
        assert steps == list(range(1, len(steps) + 1)) and result.metrics["step"] == steps[-1]
        ids = [
            i
            for p in ids_dir.iterdir()
            for i in json.loads(p.read_text())
            if latest[int(p.stem.split("-")[0])] == int(p.stem.split("-")[1])
        ]
        assert sorted(ids) == list(range(rows))  # every row once, whatever the resizes
        assert result.metrics["total"] == sum(range(rows))  # and so says the state restored across them
        seen = {(m["slices"], m["accum"], m["megascale"], m["mesh"]["data"]) for m in by_step.values()}
        assert seen == {(2, 1, "2", 8), (1, 2, "", 4)}  # MEGASCALE_* rebuilt per size, never stale
        assert max(m["epoch"] for m in by_step.values()) == 2
        assert all(len(m["ids"]) == 8 for s, m in by_step.items() if s < steps[-1])  # global batch kept on one slice
    finally:
        for n in names:
            if any(h.alive for h in ray_cluster.slices[n].hosts):
                ray_cluster.preempt_slice(n)
    assert live_groups() == [] and _no_actors_left() == []


@pytest.mark.ray
def test_a_process_that_dies_alone_costs_a_restart_on_the_same_size_not_a_shrink(ray_cluster, tmp_path):
    import os
    import signal

    from rayslice.train import FailureConfig, UserCallback

    from .conftest import live_groups
    from .test_train import _no_actors_left

    names = [ray_cluster.add_slice(f"v4:2x2x1@alone-{x}") for x in "ab"]
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    killed: list[int] = []

    class KillOneProcess(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics[0]["step"] >= 3 and not killed:  # rank 1's process dies; every host stays up
                killed.append(metrics[1]["pid"])
                os.kill(metrics[1]["pid"], signal.SIGKILL)

    try:
        result = _two_slices_on_ram(
            "alone", tmp_path, 8 * 8, 0.2, KillOneProcess(), FailureConfig(max_preemptions=1, max_failures=1)
        ).fit()
        assert result.error is None, result.error
        assert killed and result.attempts == 2
        # Its slice's hosts are up (their RAM stores answer): the restart keeps both slices, no shrink.
        assert result.resizes == [], [str(e) for e in result.resizes]
        assert {m["slices"] for m in result.metrics_history} == {2}
        assert result.restores[0].tier == "ram", result.restores[0]
        assert result.metrics["total"] == sum(range(8 * 8))
    finally:
        for n in names:
            if any(h.alive for h in ray_cluster.slices[n].hosts):
                ray_cluster.preempt_slice(n)
    assert live_groups() == [] and _no_actors_left() == []


def _host_processes() -> list[int]:
    """Pids of live OS processes running a rayslice gang process (Ray names them ``ray::_HostProcess...``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and "_HostProcess" in " ".join(p.info["cmdline"] or []):
                out.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@pytest.mark.ray
@pytest.mark.slow
def test_two_shrinks_and_a_grow_read_every_row_once_and_leak_nothing(ray_cluster, tmp_path):
    """The issue's case: 2 -> 1 (lost) -> 2 (grow) -> 1 (lost), per-slice batch; row ids collected across the run."""
    import ray

    from rayslice._deadline import Deadline
    from rayslice.train import FailureConfig, JaxTrainer, RunConfig, UserCallback

    from .conftest import live_groups
    from .test_train import _no_actors_left

    names = [ray_cluster.add_slice(f"v4:2x2x1@twice-{x}") for x in "ab"]
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    rows = 8 * 32
    events: list[str] = []
    seen: list[tuple[int, int]] = []  # (slices, grad_accum_steps) of every completed step

    def busy() -> list[str]:
        import rayslice

        alive = [n for n in names if all(h.alive for h in ray_cluster.slices[n].hosts)]
        return sorted(s.name for s in rayslice.list_slices() if s.state == "busy" and s.name in alive)

    class Chaos(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            m = metrics[0]
            seen.append((m["slices"], m["accum"]))
            if m["slices"] == 2 and m["step"] >= 3 and not events:
                events.append("lost-1")
                ray_cluster.preempt_slice(busy()[-1], wait=False)  # no spare: on with one slice
            elif m["slices"] == 1 and events == ["lost-1"]:
                events.append("add")
                names.append(ray_cluster.add_slice("v4:2x2x1@twice-c"))  # a node pool brings one back
            elif m["slices"] == 2 and m["epoch"] == 2 and events == ["lost-1", "add"]:
                events.append("lost-2")
                ray_cluster.preempt_slice(busy()[0], wait=False)  # the grown world loses one again

    try:
        result = JaxTrainer(
            elastic_loop,
            # Waits on the grow (1 slice, epoch 1) and on the second loss (2 slices, epoch 2), not on a step budget.
            train_loop_config={"batch": 4, "sleep_s": 0.25, "ids_dir": str(ids_dir), "hold": [[1, 1], [2, 2]]},
            scaling_config=ScalingConfig(
                topology="2x2x1",
                accelerator_type="TPU-V4",
                num_slices=2,
                min_slices=1,
                keep_global_batch=False,
                regrow_every_s=0,
                reservation_timeout_s=60,
            ),
            datasets={"train": ray.data.range(rows)},
            run_config=RunConfig(
                name="elastic-twice",
                storage_path=str(tmp_path),
                progress=False,
                callbacks=[Chaos()],
                failure_config=FailureConfig(max_preemptions=2),
            ),
        ).fit()
        assert result.error is None, result.error
        assert events == ["lost-1", "add", "lost-2"]
        assert [(e.slices_before, e.slices_after, e.reason) for e in result.resizes] == [
            (2, 1, "lost"),
            (1, 2, "grow"),
            (2, 1, "lost"),
        ]
        assert [e.elastic_epoch for e in result.resizes] == [1, 2, 3]
        assert result.goodput.resizes == tuple(result.resizes)  # each resize is an event of the goodput too
        assert "resizes: 2 -> 1 slices" in result.goodput.recovery_line()
        assert result.preemptions == 2 and result.attempts == 4
        assert set(seen) == {(2, 1), (1, 1)}  # per-slice batch: never any accumulation
        latest: dict[int, int] = {}
        for p in ids_dir.iterdir():
            step, attempt, _ = map(int, p.stem.split("-"))
            latest[step] = max(latest.get(step, 0), attempt)
        ids = [
            i
            for p in ids_dir.iterdir()
            for i in json.loads(p.read_text())
            if latest[int(p.stem.split("-")[0])] == int(p.stem.split("-")[1])
        ]
        assert sorted(ids) == list(range(rows))  # every row of the epoch once, across two shrinks and a grow
        assert result.metrics["total"] == sum(range(rows))
    finally:
        for n in names:
            if any(h.alive for h in ray_cluster.slices[n].hosts):
                ray_cluster.preempt_slice(n)
    assert live_groups() == [] and _no_actors_left() == []
    deadline = Deadline(30)
    while _host_processes():  # a gang process's OS process exits a moment after its actor is gone
        deadline.sleep_or_raise(0.2, f"gang processes left behind: {_host_processes()}")
