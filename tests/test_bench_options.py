"""The benchmark scripts' command line (``benchmarks/_options.py``): properties over many inputs, and every script's
refusal of a bad word with one line and rc 2 before anything starts (no Ray here: nothing may start)."""

from __future__ import annotations

import doctest
import importlib.util
import math
import os
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_options = _load("_options_under_test", os.path.join(BENCH, "_options.py"))  # imports nothing of benchmarks/


def _script(monkeypatch, name: str) -> Any:
    monkeypatch.syspath_prepend(BENCH)  # each script imports _options, as run.py and the script's folder allow
    return _load(f"{name}_under_test", os.path.join(BENCH, f"{name}.py"))


def run(
    dry_run: bool = False,
    rows: int = 10,
    step_s: float = 0.2,
    sizes_mb: tuple[int, ...] = (4, 8),
    parts: str = "a,b",
    pipelined: bool = False,
    target_ms: float | None = None,
) -> None:
    """A run function of every kind of option."""


def _parse(argv: list[str]) -> dict[str, Any]:
    return _options.parse_options(argv, {"--gpu"}, "t.py [--gpu]", lambda flags: run)[1]


def test_doctest():
    assert doctest.testmod(_options, optionflags=doctest.ELLIPSIS).failed == 0


@given(n=st.integers(-(10**6), 10**6))
def test_integers_positive_only(n):
    word = f"rows={n}"
    if n >= 1:
        assert _parse([word]) == {"rows": n}
    else:
        with pytest.raises(ValueError, match=rf"^'rows={n}': expected rows=<positive integer>$"):
            _parse([word])


@given(x=st.floats(allow_nan=True, allow_infinity=True))
def test_floats_positive_and_finite_only(x):
    for key in ("step_s", "target_ms"):  # a plain float, and an optional one
        if math.isfinite(x) and x > 0:
            assert _parse([f"{key}={x!r}"]) == {key: x}
        else:
            with pytest.raises(ValueError, match=rf"expected {key}=<positive number>"):
                _parse([f"{key}={x!r}"])


@given(values=st.lists(st.integers(-5, 10**4), min_size=1, max_size=6))
def test_lists_of_positive_integers_come_back_sorted(values):
    word = "sizes_mb=" + ",".join(map(str, values))
    if min(values) >= 1:
        assert _parse([word]) == {"sizes_mb": tuple(sorted(values))}
    else:
        with pytest.raises(ValueError, match=r"expected sizes_mb=<positive integers, e\.g\. 4,8>"):
            _parse([word])


@given(argv=st.lists(st.text(max_size=12), max_size=5))
def test_any_words_give_options_or_one_line_valueerror(argv):
    try:  # nothing but a ValueError, whatever the words
        flags, kwargs = _options.parse_options(argv, {"--gpu"}, "t.py [--gpu]", lambda flags: run)
    except ValueError as e:
        assert len(str(e).splitlines()) == 1 or any("\n" in a or "\r" in a for a in argv)
    else:
        assert flags <= {"--gpu"} and set(kwargs) <= set(run.__annotations__) - {"dry_run", "return"}


def test_bools_text_flags_unknown_and_twice():
    for word, value in (("1", True), ("true", True), ("YES", True), ("0", False), ("false", False), ("no", False)):
        assert _parse([f"pipelined={word}"]) == {"pipelined": value}
    assert _parse(["parts=x"]) == {"parts": "x"}
    assert _parse(["--gpu"]) == {}
    for argv, message in (
        (["pipelined=2"], "'pipelined=2': expected pipelined=<0 or 1>"),
        (["parts="], "'parts=': expected parts=<text>"),
        (["rows"], "'rows': expected rows=<positive integer>"),
        (["dry_run=1"], "unknown option(s) ['dry_run']"),  # a flag, not an option
        (["--cpu"], "unknown flag(s) ['--cpu']; usage: t.py [--gpu]"),
        (["rows=1", "rows=2"], "'rows' given twice"),
        (["sizes_mb=4,,8"], "expected sizes_mb=<positive integers"),
    ):
        with pytest.raises(ValueError) as e:
            _parse(argv)
        assert message in str(e.value)


def test_an_option_without_a_reading_is_a_programming_error():
    def odd(shape: dict = {}) -> None:  # noqa: B006
        pass

    with pytest.raises(TypeError, match="'shape'"):
        _options.parse_options([], set(), "", lambda flags: odd)


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("bench_elastic", ["round=3"], "unknown option(s) ['round']; this benchmark takes ['rounds', 'step_s'"),
        ("bench_elastic", ["step_s=0"], "'step_s=0': expected step_s=<positive number>"),
        ("bench_serve", [], "expected a sub-command, parts or run"),
        ("bench_serve", ["parts", "requests_n=3"], "unknown option(s) ['requests_n']; this benchmark takes ['calls'"),
        ("bench_serve", ["run", "rounds=x"], "'rounds=x': expected rounds=<positive integer>"),
        ("bench_train", ["fit"], "expected a sub-command, one of production, report_cost, overhead"),
        ("bench_train", ["production", "parts=recovery,raylsice"], "expected a comma-separated choice of recovery"),
        ("bench_train", ["production", "kills=50,x"], "'kills=50,x': expected kills=<positive integers"),
        ("bench_train", ["overhead", "target_ms=7"], "target_ms=7: expected one of the rows' steps, [3.5, 50.0]"),
        ("bench_train", ["overhead", "pipelined=maybe"], "expected pipelined=<0 or 1>"),
        ("bench_train", ["report_cost", "rounds=2", "rounds=3"], "'rounds' given twice"),
    ],
)
def test_every_script_refuses_a_bad_word_before_anything_starts(monkeypatch, capsys, script, argv, message):
    mod = _script(monkeypatch, script)
    assert mod.main(argv) == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == "" and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layout", "rows"], "layout='rows' is not valid: expected one of 'auto', 'tensor', 'data_tensor'"),
        (["--tensor-parallel", "3"], "tensor_parallel=3 is not valid: expected a divisor of 4"),
        (["--max-tokens", "500"], "--max-tokens 500: expected 1 to 128"),
        (["--requests", "0"], "--requests 0: expected a positive number of streams"),
        (["--requests", "x"], "argument --requests: invalid int value: 'x'"),
    ],
)
def test_bench_llm_refuses_a_bad_flag_before_a_cluster_starts(monkeypatch, capsys, argv, message):
    mod = _script(monkeypatch, "bench_llm")  # argparse: its usage, then one error line, rc 2
    with pytest.raises(SystemExit) as exit_:
        mod.main(argv)
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    assert out.err.startswith("usage: bench_llm.py ")
    assert out.err.strip().splitlines()[-1].startswith(f"bench_llm.py: error: {message}")


def test_the_scripts_options_are_their_run_functions_parameters(monkeypatch):
    train, serve, elastic = (_script(monkeypatch, s) for s in ("bench_train", "bench_serve", "bench_elastic"))

    def parsed(target: Any, argv: list[str]) -> dict[str, Any]:
        return _options.parse_options(argv, set(), "", lambda _: target)[1]

    got = parsed(train.production, ["kills=150,50", "parts=ray", "heartbeat_timeout_s=0.5", "chaos_rounds=2"])
    assert got == {"kills": (50, 150), "parts": "ray", "heartbeat_timeout_s": 0.5, "chaos_rounds": 2}
    assert parsed(train.overhead_alone, ["target_ms=50", "pipelined=1"]) == {"target_ms": 50.0, "pipelined": True}
    assert parsed(train.report_cost, ["step_ms=1.5"]) == {"step_ms": 1.5}
    assert parsed(serve.run, ["seconds=2.5", "clients=4"]) == {"seconds": 2.5, "clients": 4}
    assert parsed(elastic.run, ["steps=90"]) == {"steps": 90}
    assert train._check_parts("ray, rayslice") == {"ray", "rayslice"}
    assert [c[0] for c in train._check_target(None)] == [c[0] for c in train.OVERHEAD_CASES]
