"""iter_jax_batches and batch_predict across the 2 hosts of a simulated slice (global arrays span both)."""

from __future__ import annotations

import numpy as np
import pytest

import rayslice
from rayslice.placement import PG_NAME_PREFIX

from .conftest import live_groups

pytestmark = pytest.mark.ray


def _consume(shard, batch_size: int, ragged: str, assemble: str = "auto") -> dict:
    """Runs on each host: feed the shard, gather every global batch's real ids on every host."""
    import jax
    from jax.experimental import multihost_utils

    from rayslice.data import RaggedBatchError, iter_jax_batches

    shapes, ids, error = [], [], None
    it = iter_jax_batches(shard, batch_size=batch_size, ragged=ragged, assemble=assemble)
    try:
        for b in it:
            shapes.append(b["id"].shape)
            assert len(b["id"].sharding.device_set) == jax.device_count() == 8
            assert not b["id"].is_fully_addressable  # truly global: half on the other host
            full = multihost_utils.process_allgather(b["id"], tiled=True)
            if "mask" in b:
                full = full[multihost_utils.process_allgather(b["mask"], tiled=True)]
            ids.extend(np.asarray(full).tolist())
    except RaggedBatchError as e:
        error = str(e)
    t = it._feeder._transfers
    return {
        "rank": jax.process_index(),
        "shapes": shapes,
        "ids": ids,
        "error": error,
        "device_joins": t.device_joins,
        "compiled": t.layouts.compiled,
    }


def _run(per_host_sources, batch_size, ragged, assemble="auto"):
    with (
        rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, progress=False) as spg,
        rayslice.SliceGang(spg, init_timeout_s=90) as gang,
    ):
        refs = [
            a.call.remote(_consume, (src, batch_size, ragged, assemble), {})
            for a, src in zip(gang.actors, per_host_sources)
        ]
        import ray

        return ray.get(refs, timeout=120)


def test_ray_dataset_split_every_row_once_over_two_hosts(ray_cluster):
    import ray

    n = 1000
    ds = ray.data.range(n).map_batches(lambda b: {"id": b["id"], "x": b["id"].astype(np.float32)})
    shards = ds.streaming_split(2, equal=False)
    out = _run(shards, batch_size=16, ragged="pad")
    assert [o["rank"] for o in out] == [0, 1]
    assert out[0]["shapes"] == out[1]["shapes"] and all(s == (32,) for s in out[0]["shapes"])
    assert sorted(out[0]["ids"]) == list(range(n))  # exactly once across both hosts
    assert out[0]["ids"] == out[1]["ids"]
    assert live_groups(PG_NAME_PREFIX) == []


def _host_rows(n0: int, n1: int, block: int | None = None):
    def make(lo, n):
        step = block or max(n, 1)
        return [{"id": np.arange(lo + i, lo + min(n, i + step))} for i in range(0, n, step)]

    return [make(0, n0), make(1000, n1)]


@pytest.mark.parametrize("ragged", ["raise", "drop", "pad"])
def test_uneven_hosts_never_hang_and_agree(ray_cluster, ragged):
    # host 0 has 42 rows, host 1 has 25: host 1 runs out at step 2 (batch 12). In blocks of 4
    # rows joined on the devices (3 rows each): every full batch is cut at rows 4 and 8, inside
    # two devices' rows, so at step 1 (the layout's second sighting) each host joins its pieces
    # there with the jitted concatenate, into global arrays that span both processes.
    out = _run(_host_rows(42, 25, block=4), batch_size=12, ragged=ragged, assemble="device")
    a, b = out
    assert a["shapes"] == b["shapes"]
    if ragged == "raise":
        assert len(a["shapes"]) == 2
        assert a["error"] == b["error"] and "host 0: 12, host 1: 1 row(s) left for batch_size 12" in a["error"]
    elif ragged == "drop":
        assert len(a["shapes"]) == 2 and a["error"] is None
        assert sorted(a["ids"]) == list(range(24)) + list(range(1000, 1024))
    else:
        # pad runs until every host is empty: 4 steps (host 0 needs them), host 1 pads.
        assert len(a["shapes"]) == 4 and a["error"] is None
        assert sorted(a["ids"]) == list(range(42)) + list(range(1000, 1025))
    assert a["compiled"] == b["compiled"] == 1 and a["device_joins"] == b["device_joins"] == 1


def test_pad_with_an_empty_host(ray_cluster):
    out = _run(_host_rows(10, 0), batch_size=8, ragged="pad")
    assert out[0]["shapes"] == out[1]["shapes"] == [(16,), (16,)]
    assert sorted(out[1]["ids"]) == list(range(10))


def _double(batch):
    return {"y": batch["x"] * 2.0, "norm": batch["v"].sum(axis=1)}


def test_batch_predict_every_row_once_aligned(ray_cluster):
    import ray

    n = 203
    big = 2**40  # ids beyond int32: they must come back exactly
    ds = ray.data.range(n).map_batches(
        lambda b: {"id": b["id"] + big, "x": b["id"].astype(np.float32), "v": np.ones((len(b["id"]), 3), np.float32)}
    )
    out = rayslice.data.batch_predict(
        ds,
        _double,
        topology="2x2x2",
        accelerator_type="TPU-V4",
        batch_size=8,
        input_columns=["x", "v"],
        keep_columns=["id"],
    )
    rows = out.take_all()
    assert len(rows) == n  # no padded row leaks
    by_id = {r["id"] - big: r for r in rows}
    assert sorted(by_id) == list(range(n))
    assert all(by_id[i]["y"] == 2.0 * i and by_id[i]["norm"] == 3.0 for i in range(n))
    assert set(rows[0]) == {"id", "y", "norm"}
    assert live_groups(PG_NAME_PREFIX) == []


def test_ray_dataset_in_one_process(ray_cluster):
    import ray

    from rayslice.data import iter_jax_batches

    ds = ray.data.range(50)
    it = iter_jax_batches(ds, batch_size=8, ragged="pad")
    seen = []
    for b in it:
        seen.extend(np.asarray(b["id"])[np.asarray(b["mask"])].tolist())
    assert sorted(seen) == list(range(50))
    # Resume mid-way over a Ray Dataset: within the first fetch, and past whole fetches
    # (rows are fetched 16 batches = 128 rows at a time).
    ordered = ray.data.range(400).repartition(1)
    for consumed in (2, 20):
        it = iter_jax_batches(ordered, batch_size=8, ragged="drop")
        for _ in range(consumed):
            next(it)
        state = it.state()
        it.close()
        rest = [
            np.asarray(b["id"]).tolist() for b in iter_jax_batches(ordered, batch_size=8, ragged="drop", state=state)
        ]
        assert rest == [list(range(i, i + 8)) for i in range(8 * consumed, 400, 8)]


class _Scaler:
    """A non-array part of a model's state (like a Flax module)."""

    def apply(self, w, x):
        return x * w


def _load_state():
    import jax.numpy as jnp

    return _Scaler(), jnp.asarray(3.0)


def _predict_with_state(state, batch):
    model, w = state
    return model.apply(w, batch["x"])


def test_batch_predict_with_setup_state(ray_cluster):
    import ray

    ds = ray.data.range(40).map_batches(lambda b: {"id": b["id"], "x": b["id"].astype(np.float32)})
    out = rayslice.data.batch_predict(
        ds,
        _predict_with_state,
        setup=_load_state,
        topology="2x2x2",
        accelerator_type="TPU-V4",
        batch_size=8,
        input_columns=["x"],
        keep_columns=["id"],
    )
    rows = sorted(out.take_all(), key=lambda r: r["id"])
    assert [r["prediction"] for r in rows] == [3.0 * i for i in range(40)]


def _disagreeing_hosts() -> list[str]:
    """Runs on each host: one case per row, every host in the same order; returns what each case ended with."""
    import jax

    from rayslice.data import iter_jax_batches

    r = jax.process_index()
    ids = np.arange(16)
    cases = [
        ([{"id": ids}], dict(batch_size=8 if r == 0 else 16)),
        ([{"id": ids, "x": ids * 1.0} if r == 0 else {"id": ids}], dict(batch_size=8)),
        ([{"id": ids, "x": ids.astype(np.int32 if r == 0 else np.float32)}], dict(batch_size=8)),
        ([{"id": ids, "name": np.array(["a"] * 16) if r == 1 else ids}], dict(batch_size=8)),
        ([{"id": np.arange(12) + 100 * r}], dict(batch_size=8, drop_last=False)),  # Ray's default: keep
        ([{"id": np.arange(12 if r == 0 else 10)}], dict(batch_size=8, prefetch_batches=1)),
    ]
    out = []
    for source, kwargs in cases:
        try:
            shapes = [b["id"].shape for b in iter_jax_batches(source, agreement_timeout_s=60, **kwargs)]
            out.append(f"ok {shapes}")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_hosts_that_disagree_fail_together_naming_the_difference(ray_cluster):
    import ray

    with (
        rayslice.slice_placement_group("2x2x2", "TPU-V4", timeout_s=60, progress=False) as spg,
        rayslice.SliceGang(spg, init_timeout_s=90) as gang,
    ):
        h0, h1 = ray.get([a.call.remote(_disagreeing_hosts, (), {}) for a in gang.actors], timeout=180)
    assert (
        h0[0] == h1[0] == "ValueError: hosts disagree on batch_size (host 0: 8, host 1: 16); "
        "every host must pass the same batch_size"
    )
    assert h0[1] == h1[1] and h0[1].startswith(
        "ValueError: hosts have different columns: host 0: ['id', 'x'], host 1: ['id'] (missing on host 1: ['x']"
    )
    assert h0[2] == h1[2] and "column 'x' is int32[] on host 0 but float32[] on host 1" in h0[2]
    # A host whose own data is bad fails with the reason; the other learns it at once instead of hanging.
    assert h1[3].startswith("TypeError: column 'name' holds strings") and "host_columns=['name']" in h1[3]
    assert h0[3].startswith("RuntimeError: host 1 failed before the first step: TypeError: column 'name'")
    assert h0[4] == h1[4] == "ok [(16,), (8,)]"  # the smaller last batch, as Ray yields it
    assert h0[5] == h1[5] and "hosts hold different numbers of rows at the last batch (host 0: 4, host 1: 2)" in h0[5]


def test_batch_predict_on_a_held_slice_and_from_a_slice_request(ray_cluster):
    import ray

    from rayslice.request import SliceRequest

    ds = ray.data.range(24).map_batches(
        lambda b: {"id": b["id"], "x": b["id"].astype(np.float32), "v": np.ones((len(b["id"]), 3), np.float32)}
    )
    request = SliceRequest.parse("2x2x2", "TPU-V4")  # built once, passed down
    with rayslice.slice_placement_group(request, timeout_s=60, progress=False) as spg:
        out = rayslice.data.batch_predict(
            ds, _double, tpu_slice=spg, batch_size=8, input_columns=["x", "v"], keep_columns=["id"]
        )
        assert not spg.released  # the caller's reservation: neither reserved again nor released
        assert sorted((r["id"], r["y"]) for r in out.take_all()) == [(i, 2.0 * i) for i in range(24)]
    out = rayslice.data.batch_predict(
        ds, _double, topology=request, batch_size=8, input_columns=["x", "v"], keep_columns=["id"]
    )
    assert out.count() == 24
    assert live_groups(PG_NAME_PREFIX) == []
