"""Release quality: a self-contained package, packaging metadata, CI wiring, readable output.

Pure and fast (no Ray cluster). The wheel itself is built, installed in a fresh
virtualenv and run by ``.ci/wheel-smoke.sh`` (``make wheel-smoke``), which CI
runs after the test suite.
"""

from __future__ import annotations

import io
import logging
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from rich.console import Console

import rayslice
from rayslice._tables import LOG_WIDTH, make_console, reservations_table, slices_table
from rayslice.cluster import HostInfo, SliceInfo

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _repo_files() -> list[Path]:
    files = [
        *ROOT.joinpath("src").rglob("*.py"),
        *ROOT.joinpath("tests").rglob("*.py"),
        *ROOT.joinpath("benchmarks").rglob("*.py"),
        *ROOT.joinpath(".ci").iterdir(),
        ROOT / "Makefile",
    ]
    return [f for f in files if f.is_file() and "__pycache__" not in f.parts]


def test_no_code_or_test_looks_outside_the_repository():
    # The CRDs used to be read from a sibling checkout; every lookup is now inside the package.
    outside = ["..", "shared"]
    patterns = ["/".join(outside), "shared/" + "kuberay"]
    offenders = [f"{f.relative_to(ROOT)}: {p!r}" for f in _repo_files() for p in patterns if p in f.read_text()]
    assert offenders == []


def test_pyproject_license_is_spdx_and_setuptools_supports_it():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert minimum and int(minimum.group(1)) >= 77, setuptools  # PEP 639 license expressions
    assert not any(c.startswith("License ::") for c in PYPROJECT["project"].get("classifiers", []))


def test_package_data_ships_the_kuberay_crds_and_their_license():
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["rayslice"]
    data = ROOT / "src" / "rayslice"
    shipped = {p.relative_to(data).as_posix() for pattern in patterns for p in data.glob(pattern)}
    assert {
        "kuberay_crds/ray.io_rayclusters.yaml",
        "kuberay_crds/ray.io_rayjobs.yaml",
        "kuberay_crds/ray.io_rayservices.yaml",
        "kuberay_crds/LICENSE",
        "kuberay_crds/README.md",
    } <= shipped


def test_tool_configs():
    tool = PYPROJECT["tool"]
    assert tool["ruff"]["line-length"] == 120 and tool["ruff"]["target-version"] == "py311"
    assert {"E", "F", "W", "I", "B", "UP", "SIM"} <= set(tool["ruff"]["lint"]["select"])
    assert tool["mypy"]["python_version"] == "3.11"
    pytest_cfg = tool["pytest"]["ini_options"]
    assert "--doctest-modules" in pytest_cfg["addopts"].split()
    assert pytest_cfg["testpaths"] == ["tests", "src/rayslice"]  # doctests of EVERY module


def test_make_lint_and_ci_run_the_checks():
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    for command in ("ruff check src tests benchmarks", "ruff format --check src tests benchmarks", "mypy src/rayslice"):
        assert command in lint
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("make test") < ci.index("make lint") and ci.index("make test") < ci.index("make wheel-smoke")
    smoke = ROOT / ".ci" / "wheel-smoke.sh"
    assert os.access(smoke, os.X_OK)
    subprocess.run(["bash", "-n", str(smoke)], check=True)
    text = smoke.read_text()
    for step in (
        "-m build",
        "-m venv",
        "topology v6e 4x4",
        "k8s raycluster",
        "sim up --slice v4:2x2x2 --detach",
        " status",
        "sim down",
        "RAYSLICE_HOME=",
    ):
        assert step in text, step


def test_every_module_imports_without_ray_running_or_jax():
    # Importing rayslice (what --doctest-modules does for every file) must not start Ray or import JAX:
    # JAX is imported in host processes after their environment is set.
    code = """
import importlib, pkgutil, sys
import rayslice
names = [m.name for m in pkgutil.walk_packages(rayslice.__path__, "rayslice.")]
for name in names:
    importlib.import_module(name)
import ray
heavy = sorted(m for m in ("jax", "jaxlib", "flax", "orbax") if m in sys.modules)
print(len(names), ray.is_initialized(), heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    count, initialized, heavy = out.stdout.split(" ", 2)
    assert int(count) > 20 and initialized == "False" and heavy.strip() == "[]"


def _slices() -> list[SliceInfo]:
    def host(i: int, alive: bool = True) -> HostInfo:
        return HostInfo(i, f"{i}7b56593e1dac9c5", "192.0.2.2", alive, 4, 4)

    return [
        SliceInfo("slice-a-long-pool-name", "TPU-V4", "2x2x2", "v4-16", 4, 2, (host(0), host(1, alive=False))),
        SliceInfo("slice-b", "TPU-V4", "2x2x2", "v4-16", 4, 2, (host(0), host(1))),
    ]


def test_console_for_pipes_and_logs_is_wide_and_does_not_wrap():
    out = io.StringIO()
    console = make_console(file=out)
    assert not console.is_terminal and console.width == LOG_WIDTH
    line = "x" * 300
    console.print(line)
    assert line in out.getvalue()  # one line, not cut into 120-column pieces
    console.print(slices_table(_slices()))
    assert "slice-a-long-pool-name" in out.getvalue() and "incomplete" in out.getvalue()
    assert "…" not in out.getvalue()


def test_console_respects_a_wider_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert make_console(file=io.StringIO()).width == 200
    monkeypatch.setenv("COLUMNS", "60")
    assert make_console(file=io.StringIO()).width == LOG_WIDTH


@pytest.mark.parametrize("width", [50, 60, 80])
def test_tables_keep_slice_names_and_states_whole_in_a_narrow_terminal(width):
    console = Console(file=io.StringIO(), width=width)
    console.print(slices_table(_slices()))
    console.print(
        reservations_table(
            [{"name": "demo", "slice": "slice-a-long-pool-name", "state": "CREATED", "bundles": 2}],
            [{"name": "job", "request": "1 x v4 2x2x2", "since_s": 3}],
        )
    )
    text = console.file.getvalue()
    for whole in ("slice-a-long-pool-name", "slice-b", "incomplete", "free", "created", "waiting"):
        assert whole in text, (whole, text)


def test_quiet_ray_filters_notices_and_restores_everything(monkeypatch, capsys, tmp_path):
    import ray._private.worker as ray_worker

    from rayslice.sim import _QuietRay

    monkeypatch.delenv("RAY_DATA_LOGGING_CONFIG", raising=False)
    # Ray's log deduplicator is process-wide: lines an earlier test's simulator printed (e.g. a lost
    # host's one-line summary) would come back here as "[repeated 2x across cluster]" plus Ray's hint.
    monkeypatch.setattr(ray_worker.stdout_deduplicator, "recent", {})
    original = ray_worker.print_to_stdstream
    quiet = _QuietRay(str(tmp_path)).install()
    try:
        assert ray_worker.print_to_stdstream is not original
        assert logging.getLogger("ray.serve").level == logging.WARNING
        console_levels = [
            h.level for h in logging.getLogger("ray.data").handlers if type(h).__name__ == "PlainRayHandler"
        ]  # its console handler
        assert os.environ["RAY_DATA_LOGGING_CONFIG"].startswith(str(tmp_path))
        assert console_levels and all(level == logging.WARNING for level in console_levels)

        logging.getLogger("ray.serve").setLevel(logging.INFO)  # what `import ray.serve` does
        assert not logging.getLogger("ray.serve").filter(logging.makeLogRecord({"levelno": logging.INFO}))
        assert logging.getLogger("ray.serve").filter(logging.makeLogRecord({"levelno": logging.WARNING}))

        quiet.expect_death("deadbeef" * 7, slice_mates=["feedface" * 7])
        died = "A worker died or was killed while executing a task by an unexpected system error. ... Node ID: {}"
        assert quiet.summarize(died.format("feedface" * 7)) is None  # its gang ends with the lost host
        assert quiet.summarize(died.format("0123abcd" * 7)).startswith("a worker died unexpectedly (node 0123abcd")
        dump = (
            "Raylet is terminated. Termination is unexpected. Last 20 lines:\n    [2026-01-01 00:00:00,1 I 4242 4242] x"
        )
        ray_worker.print_to_stdstream(
            {"lines": [dump, f"The node with node id: {'deadbeef' * 7} marked dead"], "pid": "raylet", "is_err": False},
            ignore_prefix=False,
        )
        out = capsys.readouterr().out  # the simulator reports its own preemptions
        assert "deadbeef" not in out and "Raylet is terminated" not in out
        # The dump's log tail is raylet.out of the shared session: the head's raylet (another pid), not the dead one's.
        assert quiet.summarize(dump.replace("4242 4242", "7 7")) is None
        ray_worker.print_to_stdstream(
            {"lines": ["The node with node id: 0123 marked dead\nmore"], "pid": "raylet", "is_err": False},
            ignore_prefix=False,
        )
        printed = capsys.readouterr().out
        assert "0123 marked dead" in printed and "more" not in printed
    finally:
        quiet.restore()
    assert ray_worker.print_to_stdstream is original
    # Only this instance's filter goes: a simulator running for the whole test session keeps its own.
    assert quiet._serve_filter not in logging.getLogger("ray.serve").filters
    assert "RAY_DATA_LOGGING_CONFIG" not in os.environ


def test_version_is_the_package_version():
    assert rayslice.__version__ == PYPROJECT["project"]["version"]


def _resolves(dotted: str) -> bool:
    """Whether ``rayslice.a.b.C`` names a module, or an attribute reached from an importable module."""
    try:
        pkgutil.resolve_name(dotted)
    except (ImportError, AttributeError, ValueError):  # ValueError: not a dotted name at all
        return False
    return True


def test_every_rayslice_name_the_docs_and_docstrings_mention_exists():
    # A renamed function left `rayslice.k8s.crd_dir()` in the CRDs' README and a moved class
    # `rayslice.gang.WarmPool` in docs/recovery.md; a reader who follows a name must find it.
    src = ROOT / "src" / "rayslice"
    pages = {f: f.read_text() for f in [ROOT / "README.md", *ROOT.joinpath("docs").rglob("*.md"), *src.rglob("*.md")]}
    code = {f: f.read_text() for f in [*src.rglob("*.py"), *ROOT.joinpath("benchmarks").rglob("*.py")]}
    mention = re.compile(r"[`~](rayslice(?:\.[A-Za-z_]\w*)+)")
    named = {
        (f.relative_to(ROOT).as_posix(), m.group(1)) for f, t in {**pages, **code}.items() for m in mention.finditer(t)
    }
    # The pages' code examples are not run, so their imports are checked here (Python checks the code's).
    imported = re.compile(r"^from (rayslice[\w.]*) import ([\w, ]+?)(?: as \w+)?$", re.MULTILINE)
    for f, text in pages.items():
        for m in imported.finditer(text):
            named |= {(f.relative_to(ROOT).as_posix(), f"{m.group(1)}.{n.strip()}") for n in m.group(2).split(",")}
    assert len(named) > 50  # the scan sees the docs at all
    assert sorted((f, n) for f, n in named if not _resolves(n)) == []
