"""A benchmark script's command line: ``--flag`` words and ``key=value`` options, checked before anything starts.

The options a script takes are its run function's keyword parameters (``dry_run``
aside, which is a flag); one whose default is a tuple takes a comma-separated list
(``sizes_mb=4,8``, returned sorted), every other one a positive integer.

Example:
    >>> def run(dry_run=False, repeats=5, sizes_mb=(4, 8)): ...
    >>> parse_options(["--gpu", "sizes_mb=8,4"], {"--gpu"}, "demo.py [--gpu]", lambda flags: run)
    ({'--gpu'}, {'sizes_mb': (4, 8)})
    >>> parse_options(["rows=3"], set(), "demo.py", lambda flags: run)
    Traceback (most recent call last):
    ...
    ValueError: unknown option(s) ['rows']; this benchmark takes ['repeats', 'sizes_mb']
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def parse_options(
    argv: list[str],
    flags_known: set[str],
    usage: str,
    target_for: Callable[[set[str]], Callable[..., Any]],
) -> tuple[set[str], dict[str, Any]]:
    """The flags given, and the options as keyword arguments of the run function the flags pick.

    Args:
        argv: The words after the script's name.
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
    params = {k: p for k, p in inspect.signature(target).parameters.items() if k != "dry_run"}
    words = [(a, *a.partition("=")[::2]) for a in argv if not a.startswith("--")]
    unknown = sorted({k for _, k, _ in words} - set(params))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; this benchmark takes {sorted(params)}")
    kwargs: dict[str, Any] = {}
    for word, k, v in words:
        is_list = isinstance(params[k].default, tuple)
        try:
            values = [int(x) for x in v.split(",")] if is_list else [int(v)]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise ValueError(f"{word!r}: expected {k}=<positive integer{'s, e.g. 4,8' if is_list else ''}>")
        kwargs[k] = tuple(sorted(values)) if is_list else values[0]
    return flags, kwargs
