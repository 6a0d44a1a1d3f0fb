"""Tests for the pure parts of rayslice.sim: SliceSpec, host_environment, and
SimulatedCluster's constructor checks. Nothing here starts a Ray node."""

from __future__ import annotations

import doctest

import pytest
import ray

from rayslice import sim as sim_mod
from rayslice.sim import SimulatedCluster, SliceSpec, host_environment
from rayslice.topology import Topology

EXPECTED_FORM = "expected GEN:TOPOLOGY[:CHIPS_PER_HOST][@NAME]"


@pytest.mark.parametrize(
    "text,accel,topo,cph,name,hosts",
    [
        ("v4:2x2x2", "v4", "2x2x2", None, None, 2),
        ("v6e:2x4:4@pool-a", "v6e", "2x4", 4, "pool-a", 2),
        ("v6e:2x4", "v6e", "2x4", None, None, 1),
        ("TPU-V6E:4x4", "TPU-V6E", "4x4", None, None, 4),
        ("v7x:2x2x4@ironwood-0", "v7x", "2x2x4", None, "ironwood-0", 4),
        ("  v5e:8x8  ", "v5e", "8x8", None, None, 16),
        ("v6e:4X4", "v6e", "4X4", None, None, 4),
    ],
)
def test_parse_forms(text, accel, topo, cph, name, hosts):
    spec = SliceSpec.parse(text)
    assert (spec.accelerator_type, spec.topology, spec.chips_per_host, spec.name) == (accel, topo, cph, name)
    assert spec.cpus_per_host == 2
    assert spec.topology_info.num_hosts == hosts


def test_parsed_topology_info():
    t = SliceSpec.parse("v6e:2x4:4@pool-a").topology_info
    assert t == Topology.parse("v6e", "2x4", chips_per_host=4)
    assert (t.generation, t.name, t.chips_per_host) == ("v6e", "2x4", 4)


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "v4",
        "v4:",
        ":2x2x2",
        "v4-2x2x2",
        "v4:2x2x2:",
        "v4:2x2x2:four",
        "v4:2x2x2@",
        "v4:2x2x2@Pool_A",
        "v4 : 2x2x2",
        "v4:2*2*2",
    ],
)
def test_parse_garbage_lists_the_expected_form(garbage):
    with pytest.raises(ValueError) as info:
        SliceSpec.parse(garbage)
    msg = str(info.value)
    assert msg.startswith(f"{garbage!r} is not a slice; {EXPECTED_FORM}")
    assert "e.g. v4:2x2x2, v6e:4x4, v6e:2x4:4@pool-a" in msg


@pytest.mark.parametrize("bad_name", ["-pool", "pool-", "a--b-"])
def test_parse_invalid_name(bad_name):
    with pytest.raises(
        ValueError, match=(rf"^slice name '{bad_name}' is not valid; use lowercase letters, digits and '-'$")
    ):
        SliceSpec.parse(f"v4:2x2x2@{bad_name}")


@pytest.mark.parametrize("bad_name", ["Pool", "a_b", "", "-x", "x y"])
def test_constructor_invalid_name(bad_name):
    with pytest.raises(ValueError, match="is not valid; use lowercase letters, digits and '-'"):
        SliceSpec("v4", "2x2x2", name=bad_name)


def test_valid_names():
    for good in ("a", "0", "pool-a", "v4-16-0", "a-b-c"):
        assert SliceSpec("v4", "2x2x2", name=good).name == good


def test_bad_topology_error_comes_from_the_catalog():
    with pytest.raises(ValueError) as info:
        SliceSpec.parse("v4:3x3x3")
    with pytest.raises(ValueError) as catalog:
        Topology.parse("v4", "3x3x3")
    assert str(info.value) == str(catalog.value)
    assert str(info.value).startswith("'3x3x3' is not a v4 topology; valid: 2x2x1, 2x2x2,")


def test_bad_generation_error_comes_from_the_catalog():
    with pytest.raises(ValueError, match=r"^'v9' is not a known TPU generation; valid: v4, v5e"):
        SliceSpec.parse("v9:2x2")


def test_bad_chips_per_host_error_comes_from_the_catalog():
    with pytest.raises(ValueError, match=r"^chips_per_host=8 is not possible for v6e 4x4; valid: 4$"):
        SliceSpec.parse("v6e:4x4:8")


def test_wrong_rank_error():
    with pytest.raises(ValueError, match=r"v4 takes 3D shapes \(AxBxC\)"):
        SliceSpec("v4", "2x2")


@pytest.mark.parametrize("cpus", [0, -1])
def test_cpus_per_host_must_be_positive(cpus):
    with pytest.raises(ValueError, match=rf"^cpus_per_host={cpus} must be >= 1$"):
        SliceSpec("v4", "2x2x2", cpus_per_host=cpus)


def test_spec_is_frozen():
    spec = SliceSpec("v4", "2x2x2")
    with pytest.raises(AttributeError):
        spec.name = "x"  # type: ignore[misc]


def test_host_environment_v7x():
    topo = Topology.parse("v7x", "2x2x2")
    env = host_environment("iw", topo, 1)
    assert env == {
        "TPU_NAME": "iw",
        "TPU_WORKER_ID": "1",
        "TPU_ACCELERATOR_TYPE": "tpu7x-16",
        "TPU_TOPOLOGY": "2x2x2",
        "TPU_WORKER_HOSTNAMES": "iw-w-0,iw-w-1",
        "JAX_PLATFORMS": "cpu",
        # 4 chips x 2 devices per chip on v7x.
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }


@pytest.mark.parametrize(
    "spec,accel,hostnames,devices",
    [
        (("v4", "2x2x2"), "v4-16", "s-w-0,s-w-1", 4),
        (("v4", "2x2x1"), "v4-8", "s-w-0", 4),
        (("v6e", "4x4"), "v6e-16", "s-w-0,s-w-1,s-w-2,s-w-3", 4),
        (("v6e", "2x4"), "v6e-8", "s-w-0", 8),
        (("v5e", "2x2"), "v5litepod-4", "s-w-0", 4),
        (("v5p", "2x2x4"), "v5p-32", "s-w-0,s-w-1,s-w-2,s-w-3", 4),
    ],
)
def test_host_environment_per_shape(spec, accel, hostnames, devices):
    topo = Topology.parse(*spec)
    for worker in range(topo.num_hosts):
        env = host_environment("s", topo, worker)
        assert env["TPU_WORKER_ID"] == str(worker)
        assert env["TPU_ACCELERATOR_TYPE"] == accel
        assert env["TPU_TOPOLOGY"] == topo.name
        assert env["TPU_WORKER_HOSTNAMES"] == hostnames
        assert len(env["TPU_WORKER_HOSTNAMES"].split(",")) == topo.num_hosts
        assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count={devices}"
        assert devices == topo.devices_per_host
        assert env["JAX_PLATFORMS"] == "cpu"


def test_host_environment_two_4_chip_hosts():
    env = host_environment("p", Topology.parse("v6e", "2x4", chips_per_host=4), 0)
    assert env["TPU_WORKER_HOSTNAMES"] == "p-w-0,p-w-1"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_host_environment_values_are_strings():
    env = host_environment("s", Topology.parse("v4", "2x2x2"), 0)
    assert all(isinstance(v, str) for v in env.values())


@pytest.mark.parametrize("mb", [10, 0, 79])
def test_object_store_below_ray_minimum_raises(mb):
    with pytest.raises(ValueError, match=rf"^object_store_mb={mb} is below Ray's minimum of 80$"):
        SimulatedCluster([SliceSpec("v4", "2x2x2")], object_store_mb=mb)


def test_constructing_starts_nothing():
    was_initialized = ray.is_initialized()
    sim = SimulatedCluster([SliceSpec("v4", "2x2x2", name="a")], object_store_mb=80)
    assert ray.is_initialized() == was_initialized
    assert sim.slices == {} and sim.slice_names == [] and sim.num_hosts == 0
    assert sim.startup_s is None
    assert sim.dashboard_url is None
    with pytest.raises(RuntimeError, match="not running"):
        sim.address  # noqa: B018 - the property raises
    with pytest.raises(RuntimeError, match="not running"):
        sim.add_slice(SliceSpec("v4", "2x2x2"))
    with pytest.raises(ValueError, match=r"^no slice 'a'; slices: none$"):
        sim.preempt_host("a", 0)


def test_duplicate_slice_names_rejected_before_anything_starts(monkeypatch):
    import tempfile

    import ray.cluster_utils

    def must_not_run(*a, **k):
        raise AssertionError("start() began starting Ray before validating")

    monkeypatch.setattr(ray.cluster_utils, "Cluster", must_not_run)
    monkeypatch.setattr(tempfile, "mkdtemp", must_not_run)
    sim = SimulatedCluster([SliceSpec("v4", "2x2x2", name="a"), SliceSpec("v4", "2x2x1", name="a")], connect=False)
    with pytest.raises(ValueError, match=r"duplicate slice names in \['a', 'a'\]"):
        sim.start()


def test_module_doctests():
    result = doctest.testmod(sim_mod)
    assert result.failed == 0
    assert result.attempted > 0
