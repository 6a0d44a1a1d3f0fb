"""The RAM checkpoint tier: the restore choice, the stores, the host copy, and restores on the simulator."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayslice.errors import InvalidArgument
from rayslice.train import CheckpointConfig
from rayslice.train.checkpoint import checkpoints_dir, latest_complete_step, run_dir
from rayslice.train.goodput import COMPONENTS, GoodputTracker
from rayslice.train.ramtier import (
    RamCheckpoint,
    RamStore,
    buddy_ranks,
    choose_restore,
    host_copy,
    retained,
)

PLACE = {1: {0: ("a0", "a1"), 1: ("a1", "a0")}}
LABELS = {"a0": "slice-a worker 0", "a1": "slice-a worker 1"}


# -- pure logic -----------------------------------------------------------------
def test_config_validates_and_decides_the_cadences():
    cc = CheckpointConfig(ram_every_steps=2, storage_every_steps=5)
    assert [s for s in range(1, 11) if cc.ram_step(s)] == [2, 4, 6, 8, 10]
    assert [s for s in range(1, 11) if cc.storage_step(s)] == [5, 10]
    assert CheckpointConfig().storage_step(7) and not CheckpointConfig().ram_step(7)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(InvalidArgument, match="ram_every_steps"):
            CheckpointConfig(ram_every_steps=bad)
        with pytest.raises(InvalidArgument, match="storage_every_steps"):
            CheckpointConfig(storage_every_steps=bad)


def test_buddies_are_on_another_slice_or_the_next_host():
    assert buddy_ranks([0, 0, 0, 0], [0, 1, 2, 3], 1, 4) == [1, 2, 3, 0]
    assert buddy_ranks([0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1], 3, 2) == [2, 3, 4, 5, 0, 1]
    assert buddy_ranks([0], [0], 1, 1) == [0]  # one host: no replica


@given(
    world=st.integers(1, 4),
    steps=st.lists(st.integers(1, 30), min_size=0, max_size=6),
    drop=st.sets(st.integers(0, 3)),
    lost=st.sets(st.sampled_from(["s0", "s1", "s2", "s3"])),
    storage=st.one_of(st.none(), st.integers(0, 30)),
)
def test_ram_is_chosen_only_when_every_rank_of_one_step_is_reachable_and_not_older_than_storage(
    world, steps, drop, lost, storage
):
    stores = [f"s{r}" for r in range(world)]
    placement = {1: {r: (stores[r], stores[(r + 1) % world]) for r in range(world)}}
    holdings: dict[str, list] = {s: [] for s in stores}
    for step in steps:  # every rank put each step in its primary and its replica, except the dropped ones
        for r in range(world):
            if not (step == max(steps) and r in drop):
                for s in set(placement[1][r]):
                    holdings[s].append((r, 1, step, world))
    reachable = {s: h for s, h in holdings.items() if s not in lost}
    c = choose_restore(
        world_size=world,
        holdings=reachable,
        unreachable={s: "lost" for s in lost if s in holdings},
        storage_step=storage,
        placement=placement,
        labels={},
    )
    complete = [
        step
        for step in set(steps)
        if all(any((r, 1, step, world) in h for h in reachable.values()) for r in range(world))
    ]
    best = max(complete, default=None)
    if best is not None and (storage is None or best >= storage):
        assert (c.tier, c.step) == ("ram", best)
        for r, sources in c.sources.items():  # every source named holds the rank's payload
            assert all((r, 1, best, world) in reachable[s] for s in sources)
    else:
        assert c.tier == ("none" if storage is None else "storage") and c.step == storage


def test_the_reason_names_a_replica_used_and_a_replica_lost_with_its_owner():
    held = {"a0": [(0, 1, 40, 2), (1, 1, 40, 2)]}
    c = choose_restore(
        world_size=2, holdings=held, unreachable={"a1": "lost"}, storage_step=30, placement=PLACE, labels=LABELS
    )
    assert (c.tier, c.step, c.from_attempt) == ("ram", 40, 1)
    assert c.reason == "RAM step 40: every shard reachable (rank 1 from its replica on slice-a worker 0)"
    assert c.sources == {0: ("a0",), 1: ("a0",)}
    gone = choose_restore(
        world_size=2,
        holdings={},
        unreachable={"a0": "lost", "a1": "lost"},
        storage_step=30,
        placement=PLACE,
        labels=LABELS,
        newest_ram=(1, 40),
    )
    assert (gone.tier, gone.step) == ("storage", 30)
    assert "RAM step 40 unreachable: rank 0 lost with its replica (slice-a worker 0, slice-a worker 1)" in gone.reason
    older = choose_restore(world_size=2, holdings=held, unreachable={}, storage_step=50, placement=PLACE, labels=LABELS)
    assert (older.tier, older.step, older.reason) == ("storage", 50, "storage step 50: newer than RAM step 40")
    other_world = choose_restore(
        world_size=4,
        holdings={"a0": [(0, 1, 40, 2), (1, 1, 40, 2)]},
        unreachable={},
        storage_step=None,
        placement=PLACE,
        labels=LABELS,
    )
    # Another world size (an elastic resize): the saved world's ranks are the sources; the new hosts assemble.
    assert (other_world.tier, other_world.step, sorted(other_world.sources)) == ("ram", 40, [0, 1])
    assert "saved by 2 hosts, restored onto 4" in other_world.reason


def test_one_step_is_never_mixed_from_two_attempts():
    # Rank 0's step 10 from attempt 1, rank 1's from attempt 2: not one checkpoint.
    held = {"a0": [(0, 1, 10, 2), (0, 2, 8, 2)], "a1": [(1, 2, 10, 2), (1, 2, 8, 2)]}
    c = choose_restore(world_size=2, holdings=held, unreachable={}, storage_step=None, placement={}, labels={})
    assert (c.tier, c.step, c.from_attempt) == ("ram", 8, 2)


@given(
    entries=st.sets(st.tuples(st.integers(1, 3), st.integers(1, 20)), max_size=8),
    pin=st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 20))),
)
def test_a_store_keeps_at_most_two_steps_per_owner_and_never_drops_the_pinned_one(entries, pin):
    kept = retained(entries, pin)
    assert len(kept) <= 2 and kept <= set(entries)
    if pin is not None and pin in entries:
        assert pin in kept
    if pin is not None:
        assert all(a >= pin[0] and s >= pin[1] for a, s in kept)
    if entries and pin is None:
        assert max(entries, key=lambda e: (e[1], e[0])) in kept


@given(
    entries=st.sets(st.tuples(st.just(1), st.integers(1, 20)), min_size=1, max_size=8),
    floor=st.tuples(st.just(1), st.integers(1, 20)),
)
def test_a_late_buddy_keeps_the_owners_steps_from_its_own_on_but_never_more_than_four(entries, floor):
    from rayslice.train.ramtier.choice import MAX_KEPT

    kept = retained(entries, None, floor=floor)
    assert len(kept) <= MAX_KEPT and kept <= set(entries)
    assert retained(entries, None) <= kept  # the floor only ever keeps more
    wanted = sorted((e for e in entries if e[1] >= floor[1]), key=lambda e: e[1])
    if len(wanted) <= MAX_KEPT:
        assert set(wanted) <= kept


def test_a_late_pin_finds_its_step_in_every_store():
    # The driver saw step 8 complete, then 9; its pins reach the stores at different times. Store B (rank 2's
    # replica) still has pin 8 when rank 2's steps 9, 10 and 11 arrive, and gets pin 9 only afterwards: step 9
    # must still be there, or no step is complete on every store once rank 2's own host is lost.
    store = RamStore()
    store.pin(1, 8)
    for step in (8, 9, 10, 11):
        store.put(2, 1, step, {"world_size": 3, "nbytes": 8, "leaves": {}})
    store.pin(1, 9)
    held = {s for o, _, s, _ in store.inventory()["entries"] if o == 2}
    assert held == {9, 10, 11}
    for step in (12, 13, 14, 15):
        store.put(2, 1, step, {"world_size": 3, "nbytes": 8, "leaves": {}})
    held = {s for o, _, s, _ in store.inventory()["entries"] if o == 2}
    assert len(held) <= 4 and 9 in held  # bounded, the pinned step kept


def test_a_store_keeps_the_step_every_rank_completed_while_the_pin_lags():
    # Host 0's store: rank 0's own steps and rank 1's replicas. Rank 1's replica of step 8 is stuck and the
    # driver has not pinned step 6 yet: rank 0 saves 8 and 10, and step 6 must stay (it is the complete one).
    store = RamStore()
    for step in (2, 4, 6):
        store.put(1, 1, step, {"world_size": 2, "nbytes": 8, "leaves": {}})
    for step in (2, 4, 6, 8, 10):
        store.put(0, 1, step, {"world_size": 2, "nbytes": 8, "leaves": {}})
    held = {(o, s) for o, _, s, _ in store.inventory()["entries"]}
    assert {(0, 6), (1, 6)} <= held and (0, 2) not in held
    c = choose_restore(
        world_size=2,
        holdings={"a0": store.inventory()["entries"]},
        unreachable={"a1": "its host was lost"},
        storage_step=None,
        placement=PLACE,
        labels=LABELS,
    )
    assert (c.tier, c.step) == ("ram", 6), c


def test_store_copies_prunes_and_reports_bytes():
    import numpy as np

    store = RamStore()
    view = np.arange(4.0)
    view.setflags(write=False)
    for step in (2, 4, 6, 8, 10):
        store.put(0, 1, step, {"world_size": 1, "nbytes": 32, "leaves": {"w": view}})
    assert [e[2] for e in store.inventory()["entries"]] == [4, 6, 8, 10]  # at most MAX_KEPT per owner
    assert store.get(0, 1, 6)["leaves"]["w"] is not view  # a copy, not a view of the object store
    store.pin(2, 8)  # attempt 2 completed step 8: attempt 1's entries are obsolete
    inv = store.inventory()
    assert inv["entries"] == [] and inv["bytes"] == 0 and inv["peak_bytes"] == 128


def test_host_copy_then_ram_restore_is_bitwise_and_placed_like_the_target():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = NamedSharding(mesh, P("data"))
    tree = {
        "table": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16).reshape(8, 4) / 3, rows),
        "w": jax.device_put(jnp.linspace(0, 1, 5), NamedSharding(mesh, P())),
        "n": np.arange(3),
        "lr": 0.5,
    }
    leaves, nbytes = host_copy(tree)
    assert len(leaves["['w']"]["shards"]) == 1  # a replicated leaf: one copy per host
    assert nbytes == 8 * 4 * 2 + 5 * 4 + 3 * 8
    payload = {"leaves": leaves, "meta": {"step": 4, "data_states": {"data": [{"batches": 4}]}, "world_size": 1}}

    class Fetch:
        def payload(self, rank):
            assert rank == 0
            return payload

    ckpt = RamCheckpoint("ram://run/4", 4, sources={0: ("s0",)}, from_attempt=1)
    object.__setattr__(ckpt, "_fetcher", Fetch())
    target = jax.tree.map(lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) else x, tree)
    target["table"] = jax.device_put(target["table"], rows)
    back = ckpt.restore(target)
    assert back["table"].sharding == rows and back["table"].dtype == jnp.bfloat16
    for k in ("table", "w", "n"):
        assert np.asarray(back[k]).tobytes() == np.asarray(tree[k]).tobytes()
    assert back["lr"] == 0.5 and ckpt.tier == "ram" and ckpt.kind == "arrays"
    assert ckpt.metadata()["step"] == 4 and ckpt.data_state("data", rank=0) == {"batches": 4}
    with pytest.raises(ValueError, match="needs a target"):
        ckpt.restore()
    with pytest.raises(ValueError, match="no leaf"):
        ckpt.restore({"other": jnp.zeros(2)})
    with pytest.raises(ValueError, match="arrays only, no files"):
        ckpt.to_directory()


def test_goodput_books_restore_apart_from_compile_and_shows_the_recovery():
    g = GoodputTracker(clock=iter([0.0, 20.0]).__next__)
    for attempt in range(2):
        g.begin_attempt()
        g.add("reservation", 1.0 + attempt)
        g.note_restore("none" if attempt == 0 else "ram")
        g.on_reports([{"step": 1, "step_s": 2.0, "stall_s": 0.0, "first": True, "restore_s": 0.5 * attempt}])
        if attempt == 0:
            g.on_failure(None, unreported_s=1.0, detection_s=0.25)
    out = g.finish()
    assert "restore" in COMPONENTS and out.seconds["restore"] == 0.5
    assert [a["compile"] for a in out.attempts] == [2.0, 1.5]
    assert out.recovery == {
        "detection": 0.25,
        "re_reservation": 2.0,
        "startup": 0.0,
        "compile": 1.5,
        "restore": 0.5,
        "lost": 0.75,
    }
    assert out.restore_tiers == ("none", "ram") and out.as_dict()["restore_s"] == 0.5
    assert abs(sum(out.seconds.values()) - out.wall_s) < 1e-9
    table = out.table()
    assert "re-reservation" in str(table.caption) and "(ram)" in str(table.caption)


def test_a_ram_step_saved_by_another_world_restores_onto_any_sharding_bitwise():
    """An elastic resize: shards saved by two "hosts" (4 devices each) rebuild a 3-way and a 2-way sharding."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice.train.ramtier.restore import assemble

    table = np.arange(24 * 5, dtype=np.float32).reshape(24, 5) / 7
    # What two saving hosts held: rows 0-11 and 12-23, each in 4 pieces of 3 rows (a 4-device host).
    saved = {
        rank: {
            "leaves": {
                "['t']": {
                    "kind": "array",
                    "shape": (24, 5),
                    "dtype": "float32",
                    "shards": {((r, r + 3), (0, 5)): table[r : r + 3] for r in range(12 * rank, 12 * rank + 12, 3)},
                }
            },
            "meta": {"step": 6},
        }
        for rank in (0, 1)
    }

    class Fetch:
        def payload(self, rank):
            return saved[rank]

    for n in (3, 2, 1):  # rows split 3, 2 and 1 ways: no box of the target was a saved box
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        target = {"t": jax.device_put(jnp.zeros((24, 5), jnp.float32), NamedSharding(mesh, P("data")))}
        ckpt = RamCheckpoint("ram://run/6", 6, sources={0: ("s0",), 1: ("s1",)}, from_attempt=1)
        object.__setattr__(ckpt, "_fetcher", Fetch())
        back = ckpt.restore(target)
        assert back["t"].sharding == target["t"].sharding
        assert np.asarray(back["t"]).tobytes() == table.tobytes()
    assert assemble(((0, 24), (0, 5)), [(((0, 3), (0, 5)), table[:3])]) is None  # never half a leaf


# -- on the simulator ----------------------------------------------------------
@pytest.fixture(scope="module")
def ram_slices(sim):
    """Four tpu7x 2x2x2 slices of their own (no other test uses that type): the test breaks three."""
    from rayslice.sim import SliceSpec

    names = [sim.add_slice(SliceSpec("tpu7x", "2x2x2", name=f"ram-{i}")) for i in range(4)]
    yield names
    for n in names:
        if any(h.alive for h in sim.slices[n].hosts):
            sim.preempt_slice(n)


@pytest.mark.ray
@pytest.mark.slow
def test_ram_restores_after_losses_and_storage_when_a_replica_went_with_its_owner(ray_cluster, ram_slices, tmp_path):
    import ray

    import rayslice
    from rayslice.train import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

    from . import train_loops
    from .conftest import live_groups
    from .test_train import _no_actors_left

    scaling = ScalingConfig(topology="2x2x2", accelerator_type="tpu7x", init_timeout_s=120)
    ckpts = CheckpointConfig(ram_every_steps=2, storage_every_steps=10)
    cfg = {"steps": 30, "sleep_s": 0.15}

    def busy() -> str:
        return [s.name for s in rayslice.list_slices() if s.name in ram_slices and s.state == "busy"][0]

    plain = JaxTrainer(
        train_loops.ram_loop,
        train_loop_config=cfg,
        scaling_config=scaling,
        run_config=RunConfig(name="ram-plain", storage_path=str(tmp_path), progress=False, checkpoint_config=ckpts),
    ).fit()
    assert plain.error is None, plain.error
    assert plain.restores == [] and plain.ram_tier_bytes > 0

    marker = str(tmp_path / "replica-exchange")
    killed: list[str] = []
    killers: list[threading.Thread] = []

    def kill_during_exchange() -> None:  # host 1 of attempt 1 is stuck sending its replica of step 8
        if train_loops._hold(marker, timeout_s=240):
            killed.append(busy())
            ray_cluster.preempt_host(killed[-1], 1, wait=False)

    root = checkpoints_dir(run_dir(str(tmp_path), "ram-chaos"))
    hold = str(tmp_path / "hold")  # attempt 2's hosts wait after step 15 until it exists

    def kill_after_storage_step_10() -> None:
        # Once attempt 2's storage save of step 10 is committed (its hosts wait at step 15 meanwhile,
        # so that the loss lands before step 20 however slow the save): host 1 of its slice.
        deadline = time.monotonic() + 120
        while (latest_complete_step(root) or 0) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.append(busy())
        ray_cluster.preempt_host(killed[-1], 1, wait=False)  # its replica survives on host 0
        open(hold, "w").close()

    def chaos(report):
        if report["attempt"] == 2 and report["step"] >= 14 and not killers:
            killers.append(threading.Thread(target=kill_after_storage_step_10, daemon=True))
            killers[-1].start()
        elif report["attempt"] == 3 and report["step"] >= 21 and len(killed) == 2:
            killed.append(busy())
            ray_cluster.preempt_slice(killed[-1], wait=False)  # every host with its replica

    watcher = threading.Thread(target=kill_during_exchange, daemon=True)
    watcher.start()
    result = JaxTrainer(
        train_loops.ram_loop,
        train_loop_config={
            **cfg,
            "block_replica_at": 8,
            "marker": marker,
            "hold_attempt": 2,
            "hold_at": 15,
            "hold_marker": hold,
        },
        scaling_config=scaling,
        run_config=RunConfig(
            name="ram-chaos",
            storage_path=str(tmp_path),
            progress=False,
            checkpoint_config=ckpts,
            failure_config=FailureConfig(max_preemptions=3),
            callbacks=[chaos],
        ),
    ).fit()
    watcher.join(timeout=5)
    for t in killers:
        t.join(timeout=5)
    assert result.error is None, result.error
    assert len(killed) == 3 and result.preemptions == 3 and result.attempts == 4
    first, second, third = result.restores
    # Host 1 died with step 8 only in its own (dead) store: the previous complete step, never a partial one.
    assert (first.tier, first.step) == ("ram", 6), first
    assert "rank 1 from its replica" in first.reason
    assert second.tier == "ram" and second.step >= 10 and "rank 1 from its replica" in second.reason, second
    assert third.tier == "storage" and third.step in (10, 20) and "lost with its replica" in third.reason, third
    assert all(r.seconds is not None and r.seconds > 0 for r in result.restores)
    print("restore seconds:", [(r.tier, r.step, round(r.seconds or 0, 3)) for r in result.restores])
    print(result.goodput.recovery_line(), "| ram tier peak bytes per node:", result.ram_tier_bytes)
    assert result.goodput.restore_tiers == ("none", "ram", "ram", "storage")
    assert result.goodput.seconds["restore"] > 0 and result.ram_tier_bytes > 0
    steps = [h["step"] for h in result.metrics_history]
    assert sorted(set(steps)) == list(range(1, 32))
    assert result.metrics["digest"] == plain.metrics["digest"]  # bitwise identical params and optimizer state
    assert live_groups() == [] and _no_actors_left() == []
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if str(a.get("name", "")).startswith("rayslice-ram/")]
