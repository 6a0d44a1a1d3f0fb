"""iter_jax_batches called the way Ray's ``Dataset.iter_jax_batches`` is: Ray's names, call forms and results.

Pure tests feed in-memory batches (4 CPU devices, one process); the tests
marked ``ray`` use a real ``ray.data.Dataset`` and the ``DataIterator`` shards
Ray hands to training code.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from rayslice.data import FeederOptions, Ragged, RaggedBatchError, iter_jax_batches  # noqa: E402
from rayslice.errors import InvalidArgument  # noqa: E402


def rows(n: int, chunk: int = 10):
    """n rows with an int id, a float feature vector and a float label, in source batches of ``chunk``."""
    return [
        {
            "id": np.arange(i, min(n, i + chunk)),
            "x": np.stack([np.arange(i, min(n, i + chunk))] * 3, axis=1).astype(np.float64),
            "y": np.arange(i, min(n, i + chunk)).astype(np.float64) / 2,
        }
        for i in range(0, n, chunk)
    ]


def test_batch_size_defaults_to_rays_256():
    batches = list(iter_jax_batches(rows(512, chunk=100), drop_last=True))
    assert [b["id"].shape for b in batches] == [(256,), (256,)]


def test_rays_default_keeps_a_partial_last_batch_that_splits_over_devices():
    # Ray's defaults (drop_last=False, paddings=None): the last batch is yielded smaller.
    shapes = [b["x"].shape for b in iter_jax_batches(rows(20), batch_size=8, prefetch_batches=1)]
    assert shapes == [(8, 3), (8, 3), (4, 3)]
    # ...and, as in Ray, one that does not split over the 4 local devices is an error naming the fix.
    it = iter_jax_batches(rows(19), batch_size=8, drop_last=False)
    next(it), next(it)
    with pytest.raises(RaggedBatchError, match="do not split evenly over the 4 devices.*drop_last=True"):
        next(it)


def test_drop_last_drops_the_partial_batch():
    batches = list(iter_jax_batches(rows(19), batch_size=8, drop_last=True))
    assert len(batches) == 2 and all(b["id"].shape == (8,) for b in batches)
    assert "mask" not in batches[-1]


def test_scalar_paddings_pad_every_column_without_a_mask_like_ray():
    batches = list(iter_jax_batches(rows(19), batch_size=8, paddings=-1))
    assert len(batches) == 3 and sorted(batches[-1]) == ["id", "x", "y"]  # Ray adds no mask
    assert np.asarray(batches[-1]["id"]).tolist() == [16, 17, 18, -1, -1, -1, -1, -1]
    assert np.asarray(batches[-1]["y"])[3:].tolist() == [-1.0] * 5


def test_per_column_paddings():
    last = list(iter_jax_batches(rows(10), batch_size=8, paddings={"id": -1, "x": 0.0, "y": np.nan}))[-1]
    assert np.asarray(last["id"])[2:].tolist() == [-1] * 6
    assert np.isnan(np.asarray(last["y"])[2:]).all() and not np.asarray(last["x"])[2:].any()
    with pytest.raises(ValueError, match="no value for column 'y'"):
        list(iter_jax_batches(rows(10), batch_size=8, paddings={"id": -1, "x": 0.0}))


def test_paddings_with_rayslices_own_ragged_keeps_the_mask():
    last = list(iter_jax_batches(rows(10), batch_size=8, paddings=0, ragged="pad"))[-1]
    assert np.asarray(last["mask"]).tolist() == [True] * 2 + [False] * 6


def test_a_single_dtype_casts_every_column_like_ray():
    b = next(iter_jax_batches(rows(16), batch_size=8, dtypes=jnp.float32, drop_last=True))
    assert {k: v.dtype for k, v in b.items()} == {"id": jnp.float32, "x": jnp.float32, "y": jnp.float32}
    b = next(iter_jax_batches(rows(16), batch_size=8, dtypes={"x": jnp.bfloat16}))
    assert b["x"].dtype == jnp.bfloat16 and b["id"].dtype == jnp.int32


class Features:
    """A Ray-style collate function over numpy batches (Ray's NumpyBatchCollateFn when Ray Data is there)."""

    def __call__(self, batch):
        return {"features": batch["x"].astype(np.float32) * 2, "label": batch["y"].astype(np.float32)}


def test_collate_fn_reshapes_each_batch_before_transfer():
    from ray.data.collate_fn import NumpyBatchCollateFn

    class RayFeatures(NumpyBatchCollateFn):
        def __call__(self, batch):
            return Features()(batch)

    for fn in (RayFeatures(), Features()):
        b = next(iter_jax_batches(rows(16), batch_size=8, collate_fn=fn))
        assert sorted(b) == ["features", "label"] and b["features"].shape == (8, 3)
        np.testing.assert_array_equal(np.asarray(b["features"])[:, 0], 2 * np.arange(8))


def test_collate_fn_with_arrow_input_and_a_single_array_output():
    from ray.data.collate_fn import ArrowBatchCollateFn

    class IdsOnly(ArrowBatchCollateFn):
        def __call__(self, table):
            return table.column("id").to_numpy()

    out = [b for b in iter_jax_batches(rows(16), batch_size=8, collate_fn=IdsOnly())]
    assert all(isinstance(b, jax.Array) for b in out)  # one array, not a dict, as in Ray
    assert np.concatenate([np.asarray(b) for b in out]).tolist() == list(range(16))


def test_collate_fn_must_keep_the_rows():
    with pytest.raises(ValueError, match="returned 4 row.*batch of 8"):
        next(iter_jax_batches(rows(16), batch_size=8, collate_fn=lambda b: {k: v[:4] for k, v in b.items()}))


def test_local_shuffle_is_a_seeded_permutation_of_every_row():
    def ids(seed):
        return [
            i
            for b in iter_jax_batches(rows(64), batch_size=8, local_shuffle_buffer_size=16, local_shuffle_seed=seed)
            for i in np.asarray(b["id"]).tolist()
        ]

    a, b, c = ids(1), ids(1), ids(2)
    assert sorted(a) == list(range(64)) and a == b and a != c and a != list(range(64))


def test_shuffled_stream_resumes_exactly_with_a_seed():
    kw = dict(batch_size=8, local_shuffle_buffer_size=16, local_shuffle_seed=7)
    full = [np.asarray(b["id"]).tolist() for b in iter_jax_batches(rows(64), **kw)]
    it = iter_jax_batches(rows(64), **kw)
    next(it), next(it), next(it)
    state = it.state()
    it.close()
    assert [np.asarray(b["id"]).tolist() for b in iter_jax_batches(rows(64), state=state, **kw)] == full[3:]
    with pytest.raises(InvalidArgument, match="local_shuffle_seed"):
        iter_jax_batches(rows(64), batch_size=8, local_shuffle_buffer_size=16, state=state)


def test_synchronize_batches_and_prefetch_batches_are_rays_names_for_agree_and_prefetch():
    it = iter_jax_batches(rows(16), batch_size=8, synchronize_batches=True, prefetch_batches=3)
    assert it.options.agree is True and it.options.prefetch == 3
    assert len(list(it)) == 2
    with pytest.raises(InvalidArgument, match="prefetch_batches=3 .* prefetch=2"):
        iter_jax_batches(rows(16), batch_size=8, prefetch=2, prefetch_batches=3)


def test_default_batches_mix_with_params_on_a_plain_mesh_like_rays_examples():
    mesh = Mesh(np.array(jax.devices()), ("data",))  # how Ray's examples build it: Auto axes
    w = jax.device_put(jnp.ones((3,), jnp.float32), NamedSharding(mesh, P()))
    b = next(iter_jax_batches(rows(16), batch_size=8, dtypes={"x": jnp.float32}))
    out = jax.jit(lambda x, w: x @ w)(b["x"], w)  # "Mesh for all inputs should be equal" before
    np.testing.assert_allclose(np.asarray(out), 3 * np.arange(8))


def test_default_follows_the_mesh_set_with_jax_set_mesh():
    mesh = jax.make_mesh((2, 2), ("data", "model"))  # Explicit axes
    w = jax.device_put(jnp.ones((3,), jnp.float32), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        it = iter_jax_batches(rows(16), batch_size=8, dtypes={"x": jnp.float32})
        b = next(it)
        assert it.sharding.mesh == mesh and b["x"].sharding.spec == P("data")
        np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: x @ w)(b["x"], w)), 3 * np.arange(8))


def test_options_passed_whole():
    opts = FeederOptions(batch_size=8, ragged=Ragged.DROP, columns=("id",))
    a = [np.asarray(b["id"]).tolist() for b in iter_jax_batches(rows(19), options=opts)]
    assert a == [list(range(8)), list(range(8, 16))]
    with pytest.raises(InvalidArgument, match="ragged='pad' is not valid: expected left out when options="):
        iter_jax_batches(rows(19), options=opts, ragged="pad")


@pytest.mark.ray
def test_ray_dataset_and_its_data_iterators(ray_cluster):
    import ray

    ds = ray.data.range(40).map_batches(lambda b: {"id": b["id"], "x": b["id"].astype(np.float64)})
    # Dataset, as ds.iter_jax_batches(batch_size=8, drop_last=True) would be called.
    got = [np.asarray(b["id"]).tolist() for b in iter_jax_batches(ds, batch_size=8, drop_last=True)]
    assert sorted(i for b in got for i in b) == list(range(40))
    # A DataIterator, as ray.train.get_dataset_shard() returns one, and streaming_split shards.
    b = next(iter(iter_jax_batches(ds.iterator(), batch_size=8, dtypes=jnp.float32, paddings=0)))
    assert b["id"].dtype == jnp.float32 and sorted(b) == ["id", "x"]
    shard = ds.streaming_split(1)[0]
    seen = [i for b in iter_jax_batches(shard, batch_size=8, drop_last=True) for i in np.asarray(b["id"]).tolist()]
    assert sorted(seen) == list(range(40))


@pytest.mark.ray
def test_a_materialized_dataset_is_read_from_its_blocks_like_rays_iterator(ray_cluster):
    import ray

    from rayslice.data._rebatch import _is_materialized, host_batches

    def cols(b):
        return {"id": b["id"], "x": np.stack([b["id"]] * 3, axis=1).astype(np.float32), "y": b["id"] * 2}

    lazy = ray.data.range(103, override_num_blocks=7).map_batches(cols)
    stored = lazy.materialize()  # in the order its blocks completed
    assert _is_materialized(stored) and not _is_materialized(lazy)
    # The rows in the order Ray's own iterator gives them (the stored order), in batches of exactly batch_size.
    order = [i for b in stored.iter_batches(batch_size=None, batch_format="numpy") for i in b["id"].tolist()]
    assert sorted(order) == list(range(103))
    for skip in (0, 5, 30, 101):  # resuming mid-block, across whole blocks, in the last block
        got = list(host_batches(stored, 8, skip_rows=skip))
        assert [len(b["id"]) for b in got[:-1]] == [8] * (len(got) - 1)
        assert [i for b in got for i in b["id"].tolist()] == order[skip:]
        assert all((b["x"][:, 2] == b["id"]).all() and (b["y"] == 2 * b["id"]).all() for b in got)
    assert [sorted(b) for b in host_batches(stored, 50, columns=["y", "id"])] == [["id", "y"]] * 3
    # Equal splits: how the trainer shards a dataset over hosts (materialized datasets of their own).
    parts = stored.split(3, equal=True)
    read = [[i for b in host_batches(p, 4) for i in b["id"].tolist()] for p in parts]
    assert [len(r) for r in read] == [34, 34, 34] and sorted(i for r in read for i in r) == list(range(102))
    assert read == [[i for b in host_batches(p.map_batches(lambda b: b), 4) for i in b["id"].tolist()] for p in parts]
    # Empty blocks (here without columns) are skipped, as Ray's iterator skips them; a missing column is named.
    sparse = ray.data.range(20, override_num_blocks=4).map_batches(lambda b: b if b["id"][0] < 5 else {}).materialize()
    assert [i for b in host_batches(sparse, 4) for i in b["id"].tolist()] == list(range(5))
    with pytest.raises(InvalidArgument, match=r"columns=\['nope'\].*missing: \['nope'\]"):
        list(host_batches(stored, 8, columns=["nope"]))
    # Through the feeder, on devices.
    got = [np.asarray(b["id"]).tolist() for b in iter_jax_batches(stored, batch_size=8, drop_last=True)]
    assert [i for b in got for i in b] == order[:96]
