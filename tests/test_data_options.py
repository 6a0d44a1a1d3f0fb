"""FeederOptions, build_options, check_state and the step rule: properties over many inputs, good and bad.

Every bad input must raise InvalidArgument (a TypeError and a ValueError) whose
message starts with the parameter's name and shows the bad value; every good
input must be accepted. ``BAD_INPUTS`` counts the bad inputs tried (printed
at the end of the module with ``-s``).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayslice.data._steps import NEVER_PARTIAL, Step, decide
from rayslice.data.options import FeederOptions, Ragged, RaggedBatchError, build_options, check_state
from rayslice.errors import InvalidArgument

BAD_INPUTS = [0]
MANY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _report_count():
    yield
    print(f"\ntest_data_options: {BAD_INPUTS[0]} bad inputs tried, each answered by InvalidArgument naming it")


def refused(name: str, value: object, **kwargs: object) -> str:
    """Builds FeederOptions(name=value); asserts a clear refusal; returns the message."""
    BAD_INPUTS[0] += 1
    with pytest.raises(InvalidArgument) as info:
        FeederOptions(**{name: value}, **kwargs)
    return check_message(info.value, name, value)


def check_message(exc: BaseException, name: str, value: object) -> str:
    msg = str(exc)
    assert isinstance(exc, TypeError) and isinstance(exc, ValueError)
    assert msg.startswith(f"{name}=") or msg.startswith(f"{name}["), msg
    shown = repr(value)
    assert (shown if len(shown) <= 80 else shown[:70]) in msg or msg.startswith(f"{name}["), msg
    assert "expected" in msg and "\n" not in msg
    return msg


not_an_int = st.one_of(
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.just(np.float32(4.0)),
    st.complex_numbers(),
)


@MANY
@given(value=st.one_of(not_an_int, st.integers(max_value=0)))
def test_batch_size_refuses_everything_but_positive_ints(value):
    refused("batch_size", value)


@MANY
@given(value=st.integers(min_value=1, max_value=2**40))
def test_batch_size_accepts_positive_ints(value):
    assert FeederOptions(batch_size=value).batch_size == value
    assert FeederOptions(batch_size=np.int64(value)).batch_size == value


@MANY
@given(
    value=st.one_of(
        st.text(max_size=8).filter(lambda s: s.strip().lower() not in {"raise", "drop", "pad", "keep"}),
        st.integers(),
        st.none(),
        st.booleans(),
    )
)
def test_ragged_refuses_unknown_policies(value):
    assert "one of 'raise', 'drop', 'pad', 'keep'" in refused("ragged", value)


@MANY
@given(value=st.sampled_from(["raise", "drop", "pad", "keep"]), upper=st.booleans())
def test_ragged_accepts_its_strings_in_any_case(value, upper):
    policy = FeederOptions(ragged=value.upper() if upper else value, pad_value=0).ragged
    assert policy is Ragged(value) and policy == value  # a str enum: compares equal to its string


@MANY
@given(value=st.text(min_size=1, max_size=6))
def test_columns_refuse_a_lone_string(value):
    # "id" must never become ["i", "d"]
    assert f"e.g. [{value!r}]" in refused("columns", value)
    BAD_INPUTS[0] += 1
    with pytest.raises(InvalidArgument, match="host_columns="):
        FeederOptions(host_columns=value)


@MANY
@given(
    value=st.one_of(
        st.lists(st.one_of(st.integers(), st.just(""), st.none()), min_size=1, max_size=3),
        st.lists(st.sampled_from(["a", "b"]), min_size=3, max_size=4),  # duplicates
        st.integers(),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    )
)
def test_columns_refuse_non_lists_of_distinct_names(value):
    refused("columns", value)


@MANY
@given(value=st.lists(st.text(min_size=1, max_size=5), max_size=5, unique=True))
def test_columns_accept_lists_of_distinct_names(value):
    assert FeederOptions(columns=value).columns == tuple(value)


@MANY
@given(
    name=st.sampled_from(["prefetch", "agree_window"]),
    value=st.one_of(not_an_int, st.integers(max_value=0), st.integers(min_value=5000)),
)
def test_counts_refuse_bad_values(name, value):
    refused(name, value)


@MANY
@given(
    value=st.one_of(
        st.floats(max_value=0),
        st.floats(allow_nan=True).filter(lambda f: f != f),
        st.just(float("inf")),
        st.text(max_size=3),
        st.booleans(),
        st.none(),
    )
)
def test_agreement_timeout_must_be_a_positive_finite_number(value):
    refused("agreement_timeout_s", value)


@MANY
@given(
    value=st.one_of(
        st.lists(st.integers(), max_size=2),
        st.none(),
        st.just(object()),
        st.just({1: 2}),
        st.dictionaries(st.text(min_size=1, max_size=2), st.lists(st.integers()), min_size=1, max_size=2),
    )
)
def test_pad_value_must_be_a_scalar_or_a_mapping_of_scalars(value):
    refused("pad_value", value, ragged="pad")


@MANY
@given(value=st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans()).filter(lambda v: v != 0))
def test_pad_value_without_padding_is_refused_not_ignored(value):
    assert "unless ragged='pad'" in refused("pad_value", value)


@MANY
@given(
    value=st.one_of(
        st.integers(),
        st.booleans(),
        st.none(),
        st.sampled_from(["float33", "U8", "object", "str", "nope", "datetime64[s]"]),
        st.just(object),
        st.just(str),
    )
)
def test_dtypes_refuse_what_devices_cannot_hold(value):
    if value is None:
        return  # None means no cast
    refused("dtypes", value)


@pytest.mark.parametrize("value", [np.float32, "bfloat16", "int8", np.dtype("uint16"), {"x": "float16"}, None])
def test_dtypes_accept_numeric_dtypes(value):
    FeederOptions(dtypes=value)


@MANY
@given(value=st.one_of(not_an_int.filter(lambda v: v is not None), st.integers(max_value=-1)))
def test_shuffle_settings_refuse_bad_values(value):
    refused("local_shuffle_buffer_size", value)
    refused("local_shuffle_seed", value, local_shuffle_buffer_size=8)


def test_combinations_are_checked():
    cases = [
        (dict(local_shuffle_seed=1), "local_shuffle_seed=1", "local_shuffle_buffer_size"),
        (dict(columns=["x"], host_columns=["id"]), "host_columns=('id',)", "unknown: ['id']"),
        (dict(columns=["x"], dtypes={"y": "int32"}), "dtypes=['y']", "unknown: ['y']"),
        (dict(columns=["x"], ragged="pad", pad_value={"z": 0}), "pad_value=['z']", "unknown: ['z']"),
        (dict(columns=["x", "mask"], ragged="pad"), "mask_key='mask'", "not also a data column"),
        (dict(host_columns=["m"], ragged="pad", mask_key="m"), "mask_key='m'", "not also a data column"),
        (dict(ragged="drop", pad_value=-1), "pad_value=-1", "unless ragged='pad'"),
        (dict(sharding="data"), "sharding='data'", "NamedSharding"),
    ]
    for kwargs, start, hint in cases:
        BAD_INPUTS[0] += 1
        with pytest.raises(InvalidArgument) as info:
            FeederOptions(**kwargs)
        assert str(info.value).startswith(start) and hint in str(info.value), str(info.value)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        FeederOptions(8)  # type: ignore[misc]


def test_options_are_frozen_and_travel_to_hosts():
    opts = FeederOptions(batch_size=8, ragged="pad", pad_value={"x": 1.5}, dtypes={"x": np.float32}, columns=["x"])
    with pytest.raises(AttributeError):
        opts.batch_size = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="read-only"):
        opts.pad_value["x"] = 2  # type: ignore[index]
    assert pickle.loads(pickle.dumps(opts)) == opts and hash(opts) == hash(pickle.loads(pickle.dumps(opts)))
    assert opts.replace(batch_size=16).batch_size == 16
    with pytest.raises(InvalidArgument):
        opts.replace(batch_size=0)


# -- resume state -------------------------------------------------------------------------------------------------

good_state = st.fixed_dictionaries(
    {"version": st.just(1), "batches": st.integers(0, 10**9), "rows": st.integers(0, 10**12), "finished": st.booleans()}
)


@MANY
@given(state=good_state)
def test_good_states_round_trip(state):
    assert check_state(state) == state


@MANY
@given(
    state=good_state,
    key=st.sampled_from(["batches", "rows", "finished", "version"]),
    bad=st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=3), st.none(), st.integers(2, 9)),
)
def test_bad_states_name_the_field(state, key, bad):
    if key in ("batches", "rows") and isinstance(bad, int) and bad >= 0:
        return  # a valid count
    BAD_INPUTS[0] += 1
    with pytest.raises(InvalidArgument) as info:
        check_state({**state, key: bad})
    check_message(info.value, f"state[{key!r}]", bad)


@pytest.mark.parametrize("state", ["abc", [1, 2], 5, {"batch": 1}, {"rows": 1, "extra": 2}])
def test_states_that_are_not_states(state):
    BAD_INPUTS[0] += 1
    with pytest.raises(InvalidArgument, match=r"^state="):
        check_state(state)


# -- Ray's names ----------------------------------------------------------------------------------------------------


@MANY
@given(a=st.integers(1, 50), b=st.integers(1, 50))
def test_a_name_and_its_ray_alias_must_agree(a, b):
    if a == b:
        assert build_options(prefetch=a, prefetch_batches=b).prefetch == a
        return
    BAD_INPUTS[0] += 2
    with pytest.raises(InvalidArgument, match=rf"^prefetch_batches={b} .*prefetch={a}"):
        build_options(prefetch=a, prefetch_batches=b)
    with pytest.raises(InvalidArgument, match=rf"^paddings={b} .*pad_value={a}"):
        build_options(pad_value=a, paddings=b)


@pytest.mark.parametrize(
    "kwargs, start",
    [
        (dict(drop_last=True, ragged="pad"), "drop_last=True"),
        (dict(drop_last=True, ragged="keep"), "drop_last=True"),
        (dict(paddings=0, ragged="drop"), "paddings=0"),
        (dict(paddings=0, ragged="raise"), "paddings=0"),
        (dict(drop_last=1), "drop_last=1"),
        (dict(drop_last="yes"), "drop_last='yes'"),
        (dict(prefetch_batches=-1), "prefetch_batches=-1"),
        (dict(prefetch_batches=1.0), "prefetch_batches=1.0"),
        (dict(paddings=[0]), "paddings=[0]"),
        (dict(paddings={"x": None}), "paddings['x']=None"),
        (dict(synchronize_batches="no"), "agree='no'"),
        (dict(agree=True, synchronize_batches=False), "synchronize_batches=False"),
        (dict(collate_fn=3), "collate_fn=3"),
        (dict(batch_size=4.0), "batch_size=4.0"),
        (dict(columns="id"), "columns='id'"),
    ],
)
def test_ray_arguments_are_checked(kwargs, start):
    BAD_INPUTS[0] += 1
    with pytest.raises(InvalidArgument) as info:
        build_options(**kwargs)
    assert str(info.value).startswith(start), str(info.value)


@pytest.mark.parametrize(
    "kwargs, ragged, mask_key",
    [
        ({}, Ragged.RAISE, "mask"),
        (dict(ragged="pad"), Ragged.PAD, "mask"),
        (dict(pad_value=0), Ragged.PAD, "mask"),
        (dict(drop_last=True), Ragged.DROP, "mask"),
        (dict(drop_last=True, paddings=0), Ragged.DROP, "mask"),  # as in Ray, dropping wins
        (dict(drop_last=False), Ragged.KEEP, "mask"),
        (dict(prefetch_batches=1), Ragged.KEEP, "mask"),
        (dict(synchronize_batches=False), Ragged.KEEP, "mask"),
        (dict(local_shuffle_buffer_size=4), Ragged.KEEP, "mask"),
        (dict(paddings=0), Ragged.PAD, None),  # Ray's padding yields no mask
        (dict(paddings=0, mask_key="valid"), Ragged.PAD, "valid"),
        (dict(paddings=0, ragged="pad"), Ragged.PAD, "mask"),
        (dict(drop_last=False, ragged="raise"), Ragged.RAISE, "mask"),
    ],
)
def test_which_last_batch_policy_a_call_gets(kwargs, ragged, mask_key):
    opts = build_options(**kwargs)
    assert opts.ragged is ragged and (opts.mask_key == mask_key or ragged is not Ragged.PAD)


# -- the step rule ----------------------------------------------------------------------------------------------------


@MANY
@given(
    batch=st.integers(1, 16),
    hosts=st.integers(1, 4),
    data=st.data(),
    ragged=st.sampled_from(list(Ragged)),
    shards_per_host=st.sampled_from([1, 2, 4]),
)
def test_every_host_takes_the_same_documented_step(batch, hosts, data, ragged, shards_per_host):
    counts = data.draw(st.lists(st.integers(0, batch), min_size=hosts, max_size=hosts))
    shards = shards_per_host * hosts
    try:
        step = decide(counts, batch, ragged, shards)
    except RaggedBatchError as e:
        assert ragged in (Ragged.RAISE, Ragged.KEEP) and max(counts) > 0 and min(counts) < batch
        if ragged is Ragged.KEEP:
            assert len(set(counts)) > 1 or (counts[0] * hosts) % shards
        assert "drop_last=True" in str(e)
        return
    if max(counts) == 0:
        assert step is Step.END
    elif min(counts) == batch:
        assert step is Step.FULL
    else:
        assert step is {Ragged.DROP: Step.END, Ragged.PAD: Step.PAD, Ragged.KEEP: Step.KEEP}[ragged]
        assert (step is Step.END) == (ragged in NEVER_PARTIAL)  # a partial step: never yielded there
        if step is Step.KEEP:
            assert len(set(counts)) == 1 and (counts[0] * hosts) % shards == 0
