"""Train configs and the trainer's arguments, without Ray: Ray Train's vocabulary, and every bad input refused.

Bad inputs must fail at construction with ``InvalidArgument`` naming the
parameter; the property tests below count how many they tried
(``BAD_INPUTS_TRIED``, printed at the end of the module with ``-s``).
"""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayslice.errors import InvalidArgument
from rayslice.request import SliceRequest
from rayslice.topology import Topology
from rayslice.train import (
    CheckpointConfig,
    FailureConfig,
    JaxTrainer,
    RunConfig,
    ScalingConfig,
    UserCallback,
    current_context,
)
from rayslice.train.controller import Result, fresh_run_name
from rayslice.train.goodput import GoodputTracker
from rayslice.train.worker import _plain

from . import train_loops

BAD_INPUTS_TRIED: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _count_report():
    yield
    print(f"\nbad train config inputs tried: {sum(BAD_INPUTS_TRIED.values())} {dict(BAD_INPUTS_TRIED)}")


def _refused(area: str, name: str, build) -> None:
    BAD_INPUTS_TRIED[area] += 1
    with pytest.raises(InvalidArgument) as info:
        build()
    message = str(info.value)
    assert name in message and "is not valid" in message and "expected" in message, message
    assert "\n" not in message


V4 = {"topology": "2x2x2", "accelerator_type": "TPU-V4"}


# -- Ray Train's vocabulary ------------------------------------------------------
def test_scaling_config_in_ray_trains_words():
    sc = ScalingConfig(num_workers=2, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4")
    assert (sc.num_workers, sc.num_slices, sc.hosts_per_slice) == (2, 1, 2)
    four = ScalingConfig(num_workers=4, use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4")
    assert four.num_slices == 2 and four.request.num_hosts == 4  # Ray: workers in multiples of a slice's hosts
    assert ScalingConfig(**V4, num_slices=2).num_workers == 4
    assert ScalingConfig(**V4, num_slices=2, num_workers=4) == ScalingConfig(**V4, num_workers=4, num_slices=2)


def test_scaling_config_builds_its_request_once():
    sc = ScalingConfig(**V4, num_slices=2, resources_per_host={"CPU": 1})
    assert isinstance(sc.request, SliceRequest) and sc.request is sc.request
    assert sc.request.bundle_resources == {"TPU": 4.0, "CPU": 1.0} and sc.request.num_slices == 2
    assert sc.topology_info is sc.request.topology and sc.topology_info.num_hosts == 2
    # A parsed Topology or a whole SliceRequest is accepted as the topology.
    topo = Topology.parse("2x2x2", "v4")
    assert ScalingConfig(topology=topo).request.topology == topo
    assert ScalingConfig(topology=SliceRequest(topo, num_slices=2)).num_workers == 4


def test_resources_per_worker_is_rays_name_for_per_host_resources():
    sc = ScalingConfig(**V4, resources_per_worker={"TPU": 4, "CPU": 2})
    assert sc.request.bundle_resources == {"TPU": 4.0, "CPU": 2.0}
    _refused("scaling", "resources_per_worker['TPU']", lambda: ScalingConfig(**V4, resources_per_worker={"TPU": 1}))
    _refused(
        "scaling",
        "resources_per_worker",
        lambda: ScalingConfig(**V4, resources_per_worker={"CPU": 1}, resources_per_host={"CPU": 1}),
    )


def test_num_workers_that_does_not_fill_whole_slices_names_both_counts():
    with pytest.raises(InvalidArgument, match=r"num_workers=4 is not valid: expected 2 = 2 hosts .* num_slices=1"):
        ScalingConfig(**V4, num_workers=4, num_slices=1)
    with pytest.raises(InvalidArgument, match=r"num_workers=3 .* a multiple of 2"):
        ScalingConfig(**V4, num_workers=3)


def test_placement_strategy_takes_rays_names():
    for strategy in ("PACK", "SPREAD", "STRICT_SPREAD"):
        assert ScalingConfig(**V4, placement_strategy=strategy).placement_strategy == strategy
    _refused("scaling", "placement_strategy", lambda: ScalingConfig(**V4, placement_strategy="STRICT_PACK"))
    _refused("scaling", "placement_strategy", lambda: ScalingConfig(**V4, placement_strategy="pack"))


def test_run_and_failure_and_checkpoint_configs_in_ray_trains_words():
    rc = RunConfig(storage_path=None, failure_config=None, checkpoint_config=None, callbacks=None)
    assert rc.name is None and rc.storage_path == "~/rayslice_results"
    assert rc.failure_config == FailureConfig() and rc.checkpoint_config == CheckpointConfig() and rc.callbacks == ()
    assert FailureConfig(max_failures=2, max_preemption_failures=-1).max_preemptions == -1
    assert FailureConfig(max_preemptions=3).max_preemption_failures == 3
    assert FailureConfig().max_preemptions == 10
    cc = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min")
    assert (cc.num_to_keep, cc.checkpoint_score_attribute, cc.checkpoint_score_order) == (2, "loss", "min")
    assert RunConfig(worker_runtime_env={"env_vars": {"A": "1"}}).worker_runtime_env == {"env_vars": {"A": "1"}}


def test_storage_filesystem_is_refused_with_the_alternative():
    import pyarrow.fs

    assert RunConfig(storage_filesystem=pyarrow.fs.LocalFileSystem()).storage_filesystem is not None
    with pytest.raises(InvalidArgument, match="storage_filesystem=.* not supported.* gs://"):
        RunConfig(storage_filesystem=object())


def test_unnamed_runs_get_a_fresh_name_per_fit():
    rc = RunConfig(storage_path="/data")
    with pytest.raises(ValueError, match="each fit\\(\\) picks a fresh name"):
        rc.run_path  # noqa: B018
    a, b = fresh_run_name(), fresh_run_name()
    assert a != b and a.startswith("rayslice_run-")
    assert rc.run_path_for(a) == f"/data/{a}"
    assert RunConfig(name="mine", storage_path="/data").checkpoint_path == "/data/mine/checkpoints"


def test_callbacks_of_both_shapes_are_accepted():
    class Rec(UserCallback):
        pass

    class Duck:  # no base class: the shape is what counts
        def after_report(self, run_context, metrics, checkpoint):
            pass

    cbs = RunConfig(callbacks=[print, Rec(), Duck()]).callbacks
    assert len(cbs) == 3 and isinstance(cbs, tuple)
    UserCallback().after_report(None, [{}], None)  # the base hooks do nothing
    UserCallback().after_exception(None, {0: ValueError()})


def test_configs_are_frozen_and_keyword_only():
    sc = ScalingConfig(**V4)
    with pytest.raises(AttributeError):
        sc.num_slices = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ScalingConfig("2x2x2", "TPU-V4")  # type: ignore[misc]


def test_trainer_arguments_fail_at_construction():
    def loop(config):
        pass

    sc = ScalingConfig(**V4)
    _refused("trainer", "train_loop_per_worker", lambda: JaxTrainer(1, scaling_config=sc))  # type: ignore[arg-type]
    _refused("trainer", "scaling_config", lambda: JaxTrainer(loop, scaling_config=dict(V4)))  # type: ignore[arg-type]
    _refused("trainer", "scaling_config", lambda: JaxTrainer(loop))
    _refused("trainer", "run_config", lambda: JaxTrainer(loop, scaling_config=sc, run_config={"name": "x"}))
    _refused("trainer", "datasets", lambda: JaxTrainer(loop, scaling_config=sc, datasets=[1]))
    _refused("trainer", "datasets['train']", lambda: JaxTrainer(loop, scaling_config=sc, datasets={"train": 3}))
    _refused("trainer", "tpu_slice", lambda: JaxTrainer(loop, scaling_config=sc, tpu_slice="slice-a"))
    _refused("run", "callbacks[1]", lambda: RunConfig(callbacks=[print, 1]))
    _refused("run", "callbacks", lambda: RunConfig(callbacks=print))
    _refused("run", "failure_config", lambda: RunConfig(failure_config={"max_failures": 1}))
    _refused("run", "storage_path", lambda: RunConfig(storage_path=""))
    _refused("run", "storage_path", lambda: RunConfig(storage_path="ftp://host/x"))
    _refused("run", "worker_runtime_env", lambda: RunConfig(worker_runtime_env="env"))
    assert JaxTrainer(loop, scaling_config=sc).run_config == RunConfig()


def test_issue_examples_fail_with_the_parameter_named():
    _refused("scaling", "num_slices", lambda: ScalingConfig(**V4, num_slices="2"))
    _refused("scaling", "num_slices", lambda: ScalingConfig(**V4, num_slices=1.5))
    _refused("scaling", "init_timeout_s", lambda: ScalingConfig(**V4, init_timeout_s="5"))
    _refused("scaling", "use_tpu", lambda: ScalingConfig(**V4, use_tpu=False))
    _refused("scaling", "topology", lambda: ScalingConfig(accelerator_type="v4"))
    _refused("failure", "max_preemptions", lambda: FailureConfig(max_preemptions=1.5))
    _refused("checkpoint", "num_to_keep", lambda: CheckpointConfig(num_to_keep=0))
    _refused("checkpoint", "checkpoint_score_order", lambda: CheckpointConfig(checkpoint_score_order="best"))
    with pytest.raises(ValueError, match="'4x5' is not a v6e topology"):
        ScalingConfig(topology="4x5", accelerator_type="v6e")


def test_current_context_is_none_outside_a_worker():
    assert current_context() is None


# -- results and metrics ----------------------------------------------------------
def test_result_offers_rays_attributes():
    from rayslice.train import Checkpoint

    a, b = Checkpoint("/r/checkpoints/4"), Checkpoint("/r/checkpoints/8")
    r = Result(
        metrics={"loss": 0.5},
        metrics_history=[{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}],
        checkpoint=b,
        path="/r",
        error=None,
        goodput=GoodputTracker().finish(),
        attempts=1,
        preemptions=0,
        failures=0,
        name="r",
        best_checkpoints=[(a, {"loss": 0.2}), (b, {"loss": 0.5})],
    )
    assert list(r.metrics_dataframe["loss"]) == [1.0, 0.5]
    assert r.get_best_checkpoint("loss", "min") == a and r.get_best_checkpoint("loss", "max") == b
    assert r.get_best_checkpoint("accuracy", "max") is None
    with pytest.raises(InvalidArgument, match="mode='best'"):
        r.get_best_checkpoint("loss", "best")


def test_metrics_keep_their_json_types():
    import numpy as np

    value = {
        "losses": [0.5, np.float32(0.25)],
        "per_class": {"a": np.arange(3)},
        "name": "run",
        "n": np.int64(3),
        "ok": True,
        "none": None,
        "pair": (1, 2),
    }
    plain = _plain(value)
    assert plain == {
        "losses": [0.5, 0.25],
        "per_class": {"a": [0, 1, 2]},
        "name": "run",
        "n": 3,
        "ok": True,
        "none": None,
        "pair": (1, 2),
    }
    assert type(plain["n"]) is int and type(plain["losses"][1]) is float


def test_jax_metrics_become_python_values_of_their_own_type():
    import jax.numpy as jnp

    plain = _plain({"loss": jnp.float32(0.5), "n": jnp.int32(7), "v": jnp.arange(3), "b": jnp.bfloat16(2.0)})
    assert plain == {"loss": 0.5, "n": 7, "v": [0, 1, 2], "b": 2.0}
    assert type(plain["loss"]) is float and type(plain["n"]) is int and type(plain["v"][0]) is int


def test_reports_reach_the_drain_in_order_plain_or_still_computing(tmp_path):
    import jax.numpy as jnp

    from rayslice.train import worker

    with train_loops.one_host_session(tmp_path) as session:
        worker.report({"loss": 1.0, "i": 1})  # plain already: handed over as they are
        worker.report({"loss": jnp.float32(0.5) * 2, "i": 2})  # a device value: plain by the drain at the latest
        with pytest.raises(InvalidArgument, match="string keys"):
            worker.report({1: 2.0})
        out = worker.drain_reports() + worker.drain_reports()
        assert [(r["step"], r["metrics"]) for r in out] == [(1, {"loss": 1.0, "i": 1}), (2, {"loss": 1.0, "i": 2})]
        assert not session.reports and worker.drain_reports() == []
        # A computed metric that the next step donates (Flax's {"step": state.step}) is read in report():
        # by the time the drain runs, its buffer is gone.
        import jax

        step = jnp.int32(3) + 1
        step.block_until_ready()
        worker.report({"step": step})
        jax.jit(lambda a: a + 1, donate_argnums=0)(step)
        assert step.is_deleted()
        assert [r["metrics"] for r in worker.drain_reports()] == [{"step": 4}]


def test_the_first_report_and_first_save_freeze_the_heap_out_of_full_collections(tmp_path):
    # A full collection of JAX's and Orbax's objects held the GIL for over a second on a busy machine:
    # the heartbeat thread stalled and the driver took a live host for lost.
    import gc

    from rayslice.train import worker

    with train_loops.one_host_session(tmp_path):
        # Frozen objects freed by reference counting leave the frozen count (CI saw it drop by 6 in one
        # step), so the checks allow for that: a freeze would add the 1000 junk lists at once.
        worker.report({"i": 1})
        first = gc.get_freeze_count()
        assert first > 0
        junk = [[i] for i in range(1000)]  # noqa: F841 - tracked objects made after the first step
        worker.report({"i": 2})
        before_save = gc.get_freeze_count()
        assert before_save < first + 500  # a step that saves nothing freezes nothing
        d = tmp_path / "dir-ckpt"
        d.mkdir()
        (d / "x").write_text("")
        worker.report({"i": 3}, checkpoint=worker.Checkpoint.from_directory(str(d)))
        assert gc.get_freeze_count() >= before_save + 1000  # the first save froze the junk lists too


# -- properties: bad values of every config field ------------------------------------
_not_int = st.one_of(
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
_not_number = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.floats(), max_size=2), st.just(None))


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["num_slices", "num_workers", "chips_per_host"]), value=_not_int)
def test_integer_scaling_fields_refuse_non_integers(field, value):
    _refused("scaling", field, lambda: ScalingConfig(**V4, **{field: value}))


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["num_slices", "num_workers"]), value=st.integers(max_value=0))
def test_counts_below_one_are_refused(field, value):
    _refused("scaling", field, lambda: ScalingConfig(**V4, **{field: value}))


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(["reservation_timeout_s", "init_timeout_s"]),
    value=st.one_of(_not_number, st.floats(max_value=0), st.just(math.inf), st.just(math.nan)),
)
def test_timeouts_must_be_positive_finite_numbers(field, value):
    _refused("scaling", field, lambda: ScalingConfig(**V4, **{field: value}))


@settings(max_examples=40, deadline=None)
@given(
    value=st.one_of(
        st.dictionaries(
            st.text(min_size=1, max_size=4).filter(lambda k: k != "TPU"),
            st.floats(max_value=-0.01),
            min_size=1,
            max_size=2,
        ),
        st.lists(st.integers(), max_size=2),
        st.text(max_size=4).filter(bool),
    )
)
def test_bad_resources_per_host_are_refused(value):
    _refused("scaling", "resources_per_host", lambda: ScalingConfig(**V4, resources_per_host=value))


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(["max_failures", "max_preemptions", "max_preemption_failures"]),
    value=st.one_of(_not_int, st.integers(max_value=-2)),
)
def test_failure_budgets_refuse_bad_values(field, value):
    _refused("failure", field, lambda: FailureConfig(**{field: value}))


@settings(max_examples=40, deadline=None)
@given(
    field=st.sampled_from(["num_to_keep", "async_save", "checkpoint_score_order", "checkpoint_score_attribute"]),
    value=st.one_of(
        st.floats(),
        st.integers(max_value=0),
        st.text(max_size=3).filter(lambda s: s not in ("max", "min")),
        st.lists(st.integers(), max_size=1),
    ),
)
def test_checkpoint_config_refuses_bad_values(field, value):
    valid = {
        "num_to_keep": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        "async_save": lambda v: isinstance(v, bool),
        "checkpoint_score_order": lambda v: v in ("max", "min"),
        "checkpoint_score_attribute": lambda v: v is None or (isinstance(v, str) and v.strip()),
    }[field]
    if valid(value):
        return
    _refused("checkpoint", field, lambda: CheckpointConfig(**{field: value}))


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(
        ["name", "storage_path", "progress", "callbacks", "checkpoint_config", "failure_config", "worker_runtime_env"]
    ),
    value=st.one_of(
        st.integers(),
        st.floats(),
        st.text(min_size=1, max_size=4).filter(lambda s: not s.isalnum()),
        st.lists(st.integers(), min_size=1, max_size=2),
    ),
)
def test_run_config_refuses_bad_values(field, value):
    if field == "storage_path" and isinstance(value, str) and value.strip() and "://" not in value:
        return  # any other non-empty string is a (relative) path
    name = "callbacks[0]" if field == "callbacks" and isinstance(value, list) else field
    _refused("run", name, lambda: RunConfig(**{field: value}))


@settings(max_examples=40, deadline=None)
@given(topology=st.one_of(st.integers(), st.floats(), st.text(max_size=6), st.lists(st.integers(), max_size=3)))
def test_bad_topologies_fail_clearly(topology):
    BAD_INPUTS_TRIED["scaling"] += 1
    if isinstance(topology, str) and topology.strip().lower() in ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4"):
        return
    with pytest.raises(ValueError) as info:  # InvalidArgument, or the topology module's own ValueError
        ScalingConfig(topology=topology, accelerator_type="TPU-V4")
    assert "topology" in str(info.value) or repr(topology)[:10] in str(info.value)


def test_a_parsed_topology_fixes_chips_per_host():
    topo = Topology.parse("2x4", "v6e", chips_per_host=4)
    assert ScalingConfig(topology=topo, chips_per_host=4).num_workers == 2
    _refused("scaling", "chips_per_host", lambda: ScalingConfig(topology=topo, chips_per_host=8))
