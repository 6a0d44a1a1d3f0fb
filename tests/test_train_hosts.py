"""The run's host ledger (which slices a restart avoids, which hosts are lost) and the watch's status line."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rayslice.train._hosts import HostLedger
from rayslice.train._watch import CallbackFailed, status_line

SLICES = {"s0": ["n0", "n1"], "s1": ["n2", "n3"], "s2": ["n4", "n5"]}
NODES = sorted(n for ns in SLICES.values() for n in ns)


def _ledger(suspects: dict[str, str], silent: set[str], avoided: set[str] = frozenset()) -> HostLedger:
    ledger = HostLedger()
    ledger.attempt_on(SLICES)
    ledger.avoid |= set(avoided)
    for name, node in suspects.items():
        ledger.suspect(name, node, silent=node in silent)
    return ledger


def test_a_slice_whose_hosts_all_answer_stays_in_the_count():
    ledger = _ledger({"s0": "n1", "s1": "n3"}, silent={"n3"})
    ledger.confirm(lambda nodes: nodes - {"n3"})
    assert ledger.avoid == {"s1"} and ledger.lost == {"n3"}
    assert (ledger.hosts, ledger.suspect_slices, ledger.silent) == ({}, set(), set())  # asked once


def test_a_slice_avoided_for_another_reason_stays_avoided():
    # e.g. the slice of a host that sent a preemption notice: its hosts answer, it is about to go
    ledger = _ledger({}, silent=set(), avoided={"s2"})
    ledger.confirm(lambda nodes: nodes)
    assert ledger.avoid == {"s2"} and ledger.lost == set()


def test_without_anything_to_ask_the_silent_hosts_are_taken_for_lost():
    for answering in (None, _raises):
        ledger = _ledger({"s0": "n1", "s1": "n3"}, silent={"n3"})
        ledger.confirm(answering)
        assert ledger.avoid == {"s0", "s1"} and ledger.lost == {"n3"}


def _raises(nodes: set[str]) -> set[str]:
    raise TimeoutError("no answer")


def test_a_new_reservation_forgets_what_it_avoided_but_not_the_lost_hosts():
    ledger = _ledger({"s1": "n3"}, silent={"n3"})
    ledger.lose(["n2"])
    ledger.reserved()
    assert (ledger.avoid, ledger.suspect_slices, ledger.silent, ledger.lost) == (set(), set(), set(), {"n2"})


@given(
    suspects=st.dictionaries(st.sampled_from(sorted(SLICES)), st.sampled_from(NODES)),
    silent=st.sets(st.sampled_from(NODES)),
    avoided=st.sets(st.sampled_from(sorted(SLICES))),
    lost_before=st.sets(st.sampled_from(NODES)),
    up=st.sets(st.sampled_from(NODES)),
)
def test_confirm_properties(suspects, silent, avoided, lost_before, up):
    ledger = _ledger(suspects, silent, avoided)
    ledger.lose(lost_before)
    before = set(ledger.avoid)
    ledger.confirm(lambda nodes: nodes & up)
    assert ledger.lost == lost_before | (set(NODES) - up)  # what does not answer is lost; nothing is found again
    for name, nodes in SLICES.items():
        if set(nodes) & ledger.lost:
            assert name in ledger.avoid  # a slice with a lost host is never counted free
        elif name in suspects:
            assert name not in ledger.avoid  # every host answers: a dead process alone shrinks nothing
        else:
            assert (name in ledger.avoid) == (name in before)  # nothing learned: as it was


@given(
    step=st.integers(0, 10**6),
    metrics=st.dictionaries(st.text("abc", min_size=1, max_size=3), st.floats(allow_nan=False) | st.integers()),
    attempt=st.integers(1, 9),
    restarts=st.integers(0, 9),
)
def test_status_line_shows_the_step_at_most_four_metrics_and_the_attempt(step, metrics, attempt, restarts):
    line = status_line({"step": step, "metrics": metrics}, attempt, restarts)
    head, shown, tail = line.split(" | ")
    assert head == f"step {step}" and tail == f"attempt {attempt}, restarts {restarts}"
    assert len([p for p in shown.split(", ") if p]) == min(4, len(metrics))


def test_a_failed_callback_carries_its_error():
    error = ValueError("bad metric")
    failed = CallbackFailed(error)
    assert failed.error is error and "bad metric" in str(failed)
