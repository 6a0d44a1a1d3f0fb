"""A benchmark script's command line: ``--flag`` words and ``key=value`` options, checked before anything starts.

The options a script takes are its run function's keyword parameters (``dry_run``
aside, which is a flag), read as the parameter's annotation says: ``int`` a positive
integer, ``float`` a positive number, ``bool`` ``0``/``1`` (or ``true``/``false``),
``str`` any text that is not empty, ``tuple[int, ...]`` a comma-separated list of
positive integers (``sizes_mb=4,8``, returned sorted). An optional parameter
(``float | None = None``) takes the same values as its type; an option given twice
is refused.

Example:
    >>> def run(dry_run: bool = False, repeats: int = 5, sizes_mb: tuple[int, ...] = (4, 8), step_s: float = 0.2):
    ...     pass
    >>> parse_options(["--gpu", "sizes_mb=8,4", "step_s=0.5"], {"--gpu"}, "demo.py [--gpu]", lambda flags: run)
    ({'--gpu'}, {'sizes_mb': (4, 8), 'step_s': 0.5})
    >>> parse_options(["rows=3"], set(), "demo.py", lambda flags: run)
    Traceback (most recent call last):
    ...
    ValueError: unknown option(s) ['rows']; this benchmark takes ['repeats', 'sizes_mb', 'step_s']
    >>> parse_options(["step_s=-1"], set(), "demo.py", lambda flags: run)
    Traceback (most recent call last):
    ...
    ValueError: 'step_s=-1': expected step_s=<positive number>
    >>> parse_command(["run", "repeats=2"], {"parts": run, "run": run}, "demo.py {parts|run}")[1]
    {'repeats': 2}
    >>> parse_command([], {"parts": run, "run": run}, "demo.py {parts|run}")
    Traceback (most recent call last):
    ...
    ValueError: expected a sub-command, parts or run; usage: demo.py {parts|run}
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")
_EXPECTED = {
    int: "positive integer",
    float: "positive number",
    bool: "0 or 1",
    str: "text",
    tuple: "positive integers, e.g. 4,8",
}


def _kind(param: inspect.Parameter, hint: Any) -> type:
    """The option's kind (one of ``_EXPECTED``'s keys): from the annotation, else from the default's type."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    kind = typing.get_origin(hint) or hint
    if kind not in _EXPECTED:
        kind = type(param.default)
    if kind not in _EXPECTED:
        raise TypeError(f"option {param.name!r}: no command-line reading for {hint or param.default!r}")
    return kind


def _value(kind: type, text: str) -> Any:
    """``text`` read as ``kind``; ValueError if it is not a valid value of it."""
    if kind is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return text.lower() in _TRUE
    if kind is str:
        if not text:
            raise ValueError(text)
        return text
    if kind is tuple:
        values = [int(x) for x in text.split(",")]
        if min(values) < 1:
            raise ValueError(text)
        return tuple(sorted(values))
    number = kind(text)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(text)
    return number


def parse_options(
    argv: list[str],
    flags_known: set[str],
    usage: str,
    target_for: Callable[[set[str]], Callable[..., Any]],
) -> tuple[set[str], dict[str, Any]]:
    """The flags given, and the options as keyword arguments of the run function the flags pick.

    Args:
        argv: The words after the script's name (and after its sub-command, if it has them).
        flags_known: The ``--flag`` words the script takes.
        usage: The script's usage line, shown after an unknown flag.
        target_for: Picks the run function from the flags given; its keyword parameters
            are the options taken.

    Raises:
        ValueError: One line naming the unknown flags or options, or the bad value and
            what is valid.
    """
    flags = {a for a in argv if a.startswith("--")}
    if flags - flags_known:
        raise ValueError(f"unknown flag(s) {sorted(flags - flags_known)}; usage: {usage}")
    target = target_for(flags)
    try:
        hints = typing.get_type_hints(target)
    except (NameError, TypeError):  # an annotation that does not resolve here: the defaults' types say it
        hints = {}
    params = {
        k: _kind(p, hints.get(k))
        for k, p in inspect.signature(target).parameters.items()
        if k != "dry_run" and p.default is not inspect.Parameter.empty
    }
    words = [(a, *a.partition("=")[::2]) for a in argv if not a.startswith("--")]
    unknown = sorted({k for _, k, _ in words} - set(params))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; this benchmark takes {sorted(params)}")
    kwargs: dict[str, Any] = {}
    for word, k, v in words:
        if k in kwargs:
            raise ValueError(f"{k!r} given twice; give each option once")
        try:
            kwargs[k] = _value(params[k], v)
        except ValueError:
            raise ValueError(f"{word!r}: expected {k}=<{_EXPECTED[params[k]]}>") from None
    return flags, kwargs


def parse_command(
    argv: list[str], commands: dict[str, Callable[..., Any]], usage: str
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """A script of sub-commands: the run function ``argv[0]`` names, and its options from the words after it.

    Args:
        argv: The words after the script's name: the sub-command, then its ``key=value`` options.
        commands: Each sub-command's run function, in the order the usage line shows them.
        usage: The script's usage line, shown after a missing or unknown sub-command.

    Raises:
        ValueError: One line: no or an unknown sub-command, or what :func:`parse_options` refuses.
    """
    target = commands.get(argv[0]) if argv else None
    if target is None:
        names = list(commands)
        choice = " or ".join(names) if len(names) <= 2 else f"one of {', '.join(names)}"
        raise ValueError(f"expected a sub-command, {choice}; usage: {usage}")
    return target, parse_options(argv[1:], set(), usage, lambda _: target)[1]


def run_script(
    argv: list[str],
    usage: str,
    run: Callable[..., dict[str, Any]],
    report: Callable[[dict[str, Any]], None],
) -> int:
    """A one-function script's ``main``: its options checked, ``run`` called, its result reported, JSON last.

    Takes ``--dry-run`` (passed to ``run`` as ``dry_run=True``) and ``run``'s keyword
    parameters as ``key=value`` words. A bad one is one line on stderr and exit status 2,
    before ``run`` starts anything.

    Example:
        >>> run_script(["n=2"], "demo.py [n=N]", lambda dry_run=False, n=1: {"n": n}, lambda r: None)
        {"n": 2}
        0
        >>> run_script(["n=0"], "demo.py [n=N]", lambda dry_run=False, n=1: {"n": n}, lambda r: None)
        2
    """
    import json
    import sys

    try:
        flags, kwargs = parse_options(argv, {"--dry-run"}, usage, lambda f: run)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    result = run(dry_run="--dry-run" in flags, **kwargs)
    report(result)
    print(json.dumps(result))  # one JSON line last, for a caller to read
    return 0
