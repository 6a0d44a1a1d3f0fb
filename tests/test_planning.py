"""Tests for rayslice.planning.plan (pure; SliceInfo/HostInfo built directly)."""

from __future__ import annotations

import doctest
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayslice import planning as planning_mod
from rayslice.cluster import HostInfo, SliceInfo
from rayslice.planning import Plan, SliceVerdict, plan
from rayslice.topology import Topology

V4_16 = Topology.parse("v4", "2x2x2")  # 2 hosts x 4 chips
V4_8 = Topology.parse("v4", "2x2x1")  # 1 host x 4 chips
V6E_16 = Topology.parse("v6e", "4x4")  # 4 hosts x 4 chips
V6E_8_ONE_HOST = Topology.parse("v6e", "2x4")  # 1 host x 8 chips
V6E_8_TWO_HOSTS = Topology.parse("v6e", "2x4", chips_per_host=4)


def make_slice(
    name: str,
    topo: Topology = V4_16,
    *,
    busy: dict[int, float] | None = None,
    dead: tuple[int, ...] = (),
    missing: tuple[int, ...] = (),
    problem: str | None = None,
) -> SliceInfo:
    """A slice as parse_slices would build it; ``busy`` maps worker id -> chips free."""
    busy = busy or {}
    chips = float(topo.chips_per_host)
    hosts = tuple(
        HostInfo(
            worker_id=w,
            node_id=f"{name}-n{w}",
            ip=f"10.0.{w}.1",
            alive=w not in dead,
            chips_total=chips,
            chips_free=0.0 if w in dead else busy.get(w, chips),
        )
        for w in range(topo.num_hosts)
        if w not in missing
    )
    return SliceInfo(
        name=name,
        accelerator_type=topo.accelerator_type,
        topology=topo.name,
        pod_type=topo.pod_type,
        chips_per_host=topo.chips_per_host,
        hosts_expected=topo.num_hosts,
        hosts=hosts,
        missing_workers=missing,
        problem=problem,
    )


def names(p: Plan) -> list[str]:
    return [s.name for s in p.chosen]


def test_picks_the_free_slice_not_a_mix_of_hosts():
    # a's host 0 and b's host 1 are free: together they would make a "slice",
    # but hosts are never mixed across slices.
    a = make_slice("a", busy={1: 0.0})
    b = make_slice("b", busy={0: 2.0})
    c = make_slice("c")
    p = plan(V4_16, [a, b, c])
    assert p.ok
    assert names(p) == ["c"]
    assert p.chosen[0] is c
    assert p.verdict("a") == SliceVerdict("a", False, "busy: host 1 has 0/4 chips free", True)
    assert p.verdict("b").reason == "busy: host 0 has 2/4 chips free"
    assert p.verdict("c") == SliceVerdict("c", True, "free", True)
    assert p.num_matching == 3


def test_all_busy_gives_empty_chosen_and_reasons():
    a = make_slice("a", busy={1: 0.0})
    b = make_slice("b", busy={0: 0.0, 1: 3.0})
    p = plan(V4_16, [a, b])
    assert not p.ok
    assert p.chosen == ()
    assert p.verdict("a").reason == "busy: host 1 has 0/4 chips free"
    assert p.verdict("b").reason == "busy: host 0 has 0/4 chips free, host 1 has 3/4 chips free"
    assert [v.usable for v in p.verdicts] == [False, False]
    assert p.num_matching == 2


def test_fractional_free_chips_formatted_compactly():
    p = plan(V4_8, [make_slice("a", V4_8, busy={0: 3.5})])
    assert p.verdict("a").reason == "busy: host 0 has 3.5/4 chips free"


def test_num_slices_two_picks_two_distinct_slices():
    slices = [make_slice(n) for n in ("c", "a", "b")]
    p = plan(V4_16, slices, num_slices=2)
    assert p.ok and p.num_slices == 2
    assert names(p) == ["a", "b"]


def test_num_slices_is_all_or_nothing():
    slices = [make_slice("a"), make_slice("b", busy={0: 0.0})]
    p = plan(V4_16, slices, num_slices=2)
    assert not p.ok
    assert p.chosen == ()
    # The verdicts still say which one was free.
    assert p.verdict("a").usable and not p.verdict("b").usable


def test_same_slice_never_counted_twice():
    p = plan(V4_16, [make_slice("a")], num_slices=2)
    assert p.chosen == () and not p.ok


def test_other_shapes_and_types_do_not_match():
    slices = [
        make_slice("v4-small", V4_8),
        make_slice("v6e", V6E_16),
        make_slice("want"),
    ]
    p = plan(V4_16, slices)
    assert names(p) == ["want"]
    assert p.num_matching == 1
    assert p.verdict("v4-small") == SliceVerdict("v4-small", False, "other shape: TPU-V4 2x2x1 (v4-8)", False)
    assert p.verdict("v6e").reason == "other shape: TPU-V6E 4x4 (v6e-16)"
    assert not p.verdict("v6e").matches_shape


def test_no_matching_slice_at_all():
    p = plan(V6E_16, [make_slice("a"), make_slice("b", V4_8)])
    assert not p.ok and p.chosen == ()
    assert p.num_matching == 0


def test_host_layout_mismatch_is_not_usable():
    one_host = make_slice("one", V6E_8_ONE_HOST)
    two_hosts = make_slice("two", V6E_8_TWO_HOSTS)
    p = plan(V6E_8_TWO_HOSTS, [one_host, two_hosts])
    assert names(p) == ["two"]
    v = p.verdict("one")
    assert not v.usable
    assert v.reason == "other host layout: 1 host(s) of 8 chips, request wants 2 of 4"
    # And the other way round.
    p = plan(V6E_8_ONE_HOST, [one_host, two_hosts])
    assert names(p) == ["one"]
    assert p.verdict("two").reason == "other host layout: 2 host(s) of 4 chips, request wants 1 of 8"


def test_dead_and_missing_hosts_are_incomplete():
    dead = make_slice("dead", V6E_16, dead=(1, 3))
    missing = make_slice("missing", V6E_16, missing=(2,))
    both = make_slice("both", V6E_16, dead=(0,), missing=(3,))
    p = plan(V6E_16, [dead, missing, both])
    assert not p.ok and p.chosen == ()
    assert p.verdict("dead").reason == "incomplete: dead host(s) 1, 3"
    assert p.verdict("missing").reason == "incomplete: missing host(s) 2"
    assert p.verdict("both").reason == "incomplete: missing host(s) 3; dead host(s) 0"
    assert all(v.matches_shape and not v.usable for v in p.verdicts)
    assert p.num_matching == 3


def test_slice_with_unknown_labels_is_not_a_match():
    odd = make_slice("odd", V4_16, problem="'3x3x3' is not a v4 topology")
    p = plan(V4_16, [odd])
    assert p.verdict("odd") == SliceVerdict("odd", False, "not a known slice ('3x3x3' is not a v4 topology)", False)
    assert p.num_matching == 0


def test_exclude_skips_a_free_slice():
    slices = [make_slice("a"), make_slice("b")]
    p = plan(V4_16, slices, exclude=["a"])
    assert names(p) == ["b"]
    assert p.verdict("a") == SliceVerdict("a", False, "skipped: lost a race for it a moment ago", True)
    # Excluding a slice that is not usable anyway keeps its real reason.
    p = plan(V4_16, [make_slice("a", busy={0: 0.0}), make_slice("b")], exclude={"a"})
    assert p.verdict("a").reason == "busy: host 0 has 0/4 chips free"
    # Excluding everything free leaves nothing.
    p = plan(V4_16, slices, exclude=("a", "b"))
    assert p.chosen == () and not p.ok


def test_exclude_accepts_a_generator():
    p = plan(V4_16, [make_slice("a"), make_slice("b")], exclude=(n for n in ["a"]))
    assert names(p) == ["b"]


def test_prefer_takes_a_free_preferred_slice_first_and_never_a_busy_one():
    slices = [make_slice("a"), make_slice("b"), make_slice("c", busy={0: 0.0})]
    assert names(plan(V4_16, slices, prefer=["b"])) == ["b"]
    assert names(plan(V4_16, slices, prefer=["c"])) == ["a"]  # busy: the preference gives way
    assert names(plan(V4_16, slices, prefer=["zz"])) == ["a"]  # unknown: name order as usual
    assert names(plan(V4_16, slices, prefer=["b"], exclude=["b"])) == ["a"]  # exclude wins


@given(
    free=st.lists(st.booleans(), min_size=1, max_size=8),
    preferred=st.sets(st.integers(0, 9)),
    excluded=st.sets(st.integers(0, 9)),
    num=st.integers(1, 4),
)
def test_property_prefer_only_reorders_the_free_slices(free, preferred, excluded, num):
    slices = [make_slice(f"s-{i}", busy=None if ok else {1: 0.0}) for i, ok in enumerate(free)]
    prefer = [f"s-{i}" for i in preferred]
    exclude = [f"s-{i}" for i in excluded]
    base = plan(V4_16, slices, num_slices=num, exclude=exclude)
    got = plan(V4_16, slices, num_slices=num, exclude=exclude, prefer=prefer)
    assert got.verdicts == base.verdicts and got.ok == base.ok  # what is usable does not change
    usable = sorted((v.slice_name for v in base.verdicts if v.usable), key=lambda n: (n not in prefer, n))
    assert names(got) == (usable[:num] if len(usable) >= num else [])


def test_deterministic_name_order():
    slices = [make_slice(n) for n in ("s-3", "s-1", "s-2", "s-0")]
    for seed in range(5):
        shuffled = slices[:]
        random.Random(seed).shuffle(shuffled)
        assert names(plan(V4_16, shuffled, num_slices=2)) == ["s-0", "s-1"]
    # Verdicts keep the input order.
    p = plan(V4_16, slices)
    assert [v.slice_name for v in p.verdicts] == ["s-3", "s-1", "s-2", "s-0"]


@pytest.mark.parametrize("n", [0, -1])
def test_num_slices_below_one_raises(n):
    with pytest.raises(ValueError, match=rf"num_slices={n} .*>= 1"):
        plan(V4_16, [make_slice("a")], num_slices=n)


def test_explain_lists_every_slice_with_reason_and_request():
    slices = [
        make_slice("z-free"),
        make_slice("b-busy", busy={1: 0.0}),
        make_slice("a-other", V4_8),
        make_slice("c-dead", dead=(0,)),
    ]
    p = plan(V4_16, slices)
    assert p.explain() == "\n".join(
        [
            "request: 1 x v4 2x2x2 (8 chips, 2 hosts x 4); 3 slice(s) of that type and shape, 1 usable now",
            "  - b-busy: busy: host 1 has 0/4 chips free",
            "  - c-dead: incomplete: dead host(s) 0",
            "  - z-free: free",
            "  - a-other: other shape: TPU-V4 2x2x1 (v4-8)",
        ]
    )
    assert str(p) == p.explain()


def test_explain_with_several_slices_requested():
    p = plan(V4_8, [make_slice("a", V4_8)], num_slices=3)
    assert p.explain().splitlines()[0] == (
        "request: 3 x v4 2x2x1 (4 chips, 1 host x 4); 1 slice(s) of that type and shape, 0 usable now"
    )


def test_explain_with_no_slices():
    p = plan(V4_16, [])
    assert not p.ok and p.num_matching == 0
    assert str(p) == (
        "request: 1 x v4 2x2x2 (8 chips, 2 hosts x 4); 0 slice(s) of that type and shape, 0 usable now\n"
        "  (the cluster has no TPU slices)"
    )


def test_verdict_unknown_name_raises_keyerror():
    p = plan(V4_16, [make_slice("a")])
    with pytest.raises(KeyError, match="nope"):
        p.verdict("nope")


def test_verdict_str():
    assert str(SliceVerdict("a", False, "busy: x", True)) == "a: busy: x"


def test_plan_over_ten_thousand_slices():
    rng = random.Random(1234)
    shapes = [V4_16, V4_8, V6E_16, V6E_8_ONE_HOST, V6E_8_TWO_HOSTS]
    slices = []
    expected_free, expected_matching = [], 0
    for i in range(10_000):
        topo = shapes[i % len(shapes)]
        name = f"s-{i:05d}"
        kind = rng.choice(["free", "busy", "dead"])
        if kind == "busy":
            s = make_slice(name, topo, busy={topo.num_hosts - 1: 0.0})
        elif kind == "dead":
            s = make_slice(name, topo, dead=(0,))
        else:
            s = make_slice(name, topo)
        slices.append(s)
        if topo == V6E_16:
            expected_matching += 1
            if kind == "free":
                expected_free.append(name)
    rng.shuffle(slices)
    p = plan(V6E_16, slices, num_slices=5, exclude=[expected_free[0]])
    assert p.ok
    assert names(p) == expected_free[1:6]
    assert len(p.verdicts) == 10_000
    assert p.num_matching == expected_matching == 2_000
    assert sum(v.usable for v in p.verdicts) == len(expected_free) - 1
    for s in p.chosen:
        assert s.pod_type == "v6e-16" and s.is_free
    # Asking for more free slices than exist gives nothing.
    p = plan(V6E_16, slices, num_slices=len(expected_free) + 1)
    assert p.chosen == ()


def test_module_doctests():
    result = doctest.testmod(planning_mod)
    assert result.failed == 0
    assert result.attempted > 0


def test_plan_agrees_with_slice_state_for_extra_host():
    s = make_slice("s")
    extra = HostInfo(2, "s-n2", "10.0.2.1", True, 4.0, 4.0)
    s = SliceInfo(
        s.name, s.accelerator_type, s.topology, s.pod_type, s.chips_per_host, s.hosts_expected, (*s.hosts, extra)
    )
    assert s.state == "incomplete"
    assert not plan(V4_16, [s]).verdict("s").usable
