"""Tests for the TPU catalog in rayslice.topology (pure; no Ray cluster)."""

from __future__ import annotations

import dataclasses
import doctest
import math

import pytest
from ray._private.accelerators.tpu import (
    VALID_TPU_TOPOLOGY,
    get_chips_per_host,
    infer_tpu_pod_type_from_topology,
    normalize_tpu_accelerator_type,
)

from rayslice import topology as topo_mod
from rayslice.topology import (
    GENERATIONS,
    Topology,
    chips_per_host_options,
    generation,
    valid_topologies,
)

# Every (generation, topology, chips_per_host) the catalog allows.
CATALOG = [
    (g, name, cph) for g in GENERATIONS for name in valid_topologies(g) for cph in chips_per_host_options(g, name)
]
IDS = [f"{g}-{n}-{c}" for g, n, c in CATALOG]


def test_generations_are_canonical_and_ordered():
    assert GENERATIONS == ("v4", "v5e", "v5p", "v6e", "v7x")
    for g in GENERATIONS:
        assert generation(g).name == g


def test_topologies_listed_smallest_first_without_duplicates():
    for g in GENERATIONS:
        shapes = valid_topologies(g)
        assert len(set(shapes)) == len(shapes)
        keys = [(math.prod(map(int, s.split("x"))), tuple(map(int, s.split("x")))) for s in shapes]
        assert keys == sorted(keys), g


@pytest.mark.parametrize(("gen", "name", "cph"), CATALOG, ids=IDS)
def test_every_catalog_entry_is_consistent(gen, name, cph):
    t = Topology.parse(gen, name, chips_per_host=cph)
    g = generation(gen)
    assert t.name == name and t.generation == gen
    assert t.num_chips == math.prod(t.shape)
    assert t.num_hosts * t.chips_per_host == t.num_chips
    assert t.devices_per_host == cph * g.devices_per_chip
    assert t.num_devices == t.num_hosts * t.devices_per_host
    assert math.prod(t.host_grid) == t.num_hosts
    assert math.prod(t.host_chip_shape) == cph
    assert tuple(h * b for h, b in zip(t.host_grid, t.host_chip_shape)) == t.shape
    assert t.is_multi_host == (t.num_hosts > 1)
    assert t.gke_machine_type == g.gke_machine_types[cph]
    assert t.gke_accelerator == g.gke_accelerator
    assert t.accelerator_type == g.accelerator_type
    assert t.head_resource == f"TPU-{t.pod_type}-head"


@pytest.mark.parametrize(("gen", "name", "cph"), CATALOG, ids=IDS)
def test_strings_match_what_ray_computes(gen, name, cph):
    t = Topology.parse(gen, name, chips_per_host=cph)
    # Ray's label for a slice requested by shape...
    assert t.pod_type == infer_tpu_pod_type_from_topology(name, t.accelerator_type)
    # ...and what Ray derives on the node from GKE's TPU_ACCELERATOR_TYPE env.
    assert normalize_tpu_accelerator_type(t.api_accelerator_type) == t.pod_type
    ray_version = normalize_tpu_accelerator_type(t.api_accelerator_type).split("-")[0]
    assert f"TPU-{ray_version.upper()}" == t.accelerator_type
    assert ray_version == generation(gen).ray_prefix


@pytest.mark.parametrize("gen", GENERATIONS)
def test_default_chips_per_host_matches_ray(gen):
    prefix = generation(gen).ray_prefix
    for name in valid_topologies(gen):
        assert Topology.parse(gen, name).chips_per_host == get_chips_per_host(name, prefix)


def test_ray_topology_table_differences_are_the_known_ones():
    # If Ray's table changes, re-check the catalog comments in topology.py.
    def ours(g):
        return set(valid_topologies(g))

    def theirs(g):
        return set(VALID_TPU_TOPOLOGY[generation(g).ray_prefix])

    assert theirs("v6e") - ours("v6e") == {"2x8"} and ours("v6e") <= theirs("v6e")
    assert theirs("v5e") - ours("v5e") == {"2x8"} and ours("v5e") <= theirs("v5e")
    assert ours("v7x") == theirs("v7x")
    assert ours("v5p") <= theirs("v5p")
    assert ours("v4") - theirs("v4") == {"4x16x16", "8x16x16", "12x16x16", "16x16x16"}
    for g in ("v4", "v5p"):  # Ray's extras are unsorted spellings like 8x4x4
        for extra in theirs(g) - ours(g):
            dims = [int(d) for d in extra.split("x")]
            assert dims != sorted(dims), extra


@pytest.mark.parametrize(
    ("gen", "name", "cph", "pod_type", "api", "hosts", "grid", "machine"),
    [
        ("v6e", "4x4", 4, "v6e-16", "v6e-16", 4, (2, 2), "ct6e-standard-4t"),
        ("v4", "2x2x2", 4, "v4-16", "v4-16", 2, (1, 1, 2), "ct4p-hightpu-4t"),
        ("v4", "2x2x1", 4, "v4-8", "v4-8", 1, (1, 1, 1), "ct4p-hightpu-4t"),
        ("v5e", "4x4", 4, "v5litepod-16", "v5litepod-16", 4, (2, 2), "ct5lp-hightpu-4t"),
        ("v5e", "1x1", 1, "v5litepod-1", "v5litepod-1", 1, (1, 1), "ct5lp-hightpu-1t"),
        ("v5p", "2x2x2", 4, "v5p-16", "v5p-16", 2, (1, 1, 2), "ct5p-hightpu-4t"),
        ("v5p", "16x16x24", 4, "v5p-12288", "v5p-12288", 1536, (8, 8, 24), "ct5p-hightpu-4t"),
        ("v7x", "2x2x2", 4, "v7x-16", "tpu7x-16", 2, (1, 1, 2), "tpu7x-standard-4t"),
        ("v7x", "4x4x4", 4, "v7x-128", "tpu7x-128", 16, (2, 2, 4), "tpu7x-standard-4t"),
        ("v6e", "16x16", 4, "v6e-256", "v6e-256", 64, (8, 8), "ct6e-standard-4t"),
    ],
)
def test_known_examples(gen, name, cph, pod_type, api, hosts, grid, machine):
    t = Topology.parse(gen, name)
    assert t.chips_per_host == cph
    assert t.pod_type == pod_type and t.api_accelerator_type == api
    assert t.num_hosts == hosts and t.host_grid == grid
    assert t.gke_machine_type == machine
    assert t.head_resource == f"TPU-{pod_type}-head"


def test_v7x_shows_two_jax_devices_per_chip():
    t = Topology.parse("tpu7x", "2x2x2")
    assert (t.devices_per_host, t.num_devices) == (8, 16)
    for g in ("v4", "v5p", "v5e", "v6e"):  # megacore or single-core chips
        assert generation(g).devices_per_chip == 1


def test_str():
    assert str(Topology.parse("v6e", "4x4")) == "v6e 4x4 (16 chips, 4 hosts x 4)"
    assert str(Topology.parse("v6e", "2x4")) == "v6e 2x4 (8 chips, 1 host x 8)"


def test_2x4_is_one_8_chip_host_unless_asked_for_two():
    for gen in ("v5e", "v6e"):
        one = Topology.parse(gen, "2x4")
        assert (one.chips_per_host, one.num_hosts, one.is_multi_host) == (8, 1, False)
        assert one.host_chip_shape == (2, 4) and one.host_grid == (1, 1)
        assert one.gke_machine_type.endswith("-8t")
        two = Topology.parse(gen, "2x4", chips_per_host=4)
        assert (two.chips_per_host, two.num_hosts, two.is_multi_host) == (4, 2, True)
        assert two.host_chip_shape == (2, 2) and two.host_grid == (1, 2)
        assert two.gke_machine_type.endswith("-4t")
        assert two.pod_type == one.pod_type  # same slice, other host split
    assert chips_per_host_options("v6e", "2x4") == (4, 8)
    assert Topology.parse("v6e", "1x1").chips_per_host == 1
    assert Topology.parse("v6e", "2x2").chips_per_host == 4


@pytest.mark.parametrize(
    "spelling",
    ["v6e", "TPU-V6E", "tpu-v6e-slice", "v6e-16", "tpu-v6e", "Trillium", " V6E "],
)
def test_v6e_spellings(spelling):
    assert generation(spelling).name == "v6e"


@pytest.mark.parametrize(
    ("spelling", "want"),
    [
        ("v5e", "v5e"),
        ("v5litepod", "v5e"),
        ("TPU-V5LITEPOD", "v5e"),
        ("tpu-v5-lite-podslice", "v5e"),
        ("v5lite", "v5e"),
        ("tpu-v5-lite-device", "v5e"),
        ("v5litepod-16", "v5e"),
        ("v4", "v4"),
        ("TPU-V4", "v4"),
        ("tpu-v4-podslice", "v4"),
        ("v4-16", "v4"),
        ("v5p", "v5p"),
        ("TPU-V5P", "v5p"),
        ("tpu-v5p-slice", "v5p"),
        ("v5p-8", "v5p"),
        ("v7x", "v7x"),
        ("TPU-V7X", "v7x"),
        ("tpu7x", "v7x"),
        ("ironwood", "v7x"),
        ("tpu7x-16", "v7x"),
        ("IRONWOOD", "v7x"),
        ("v7x-16", "v7x"),
    ],
)
def test_generation_spellings(spelling, want):
    assert generation(spelling).name == want


@pytest.mark.parametrize("bad", ["v9", "", "tpu", "v6", "v6e-", "gpu-a100", "5e", None, 6])
def test_unknown_generation_error_lists_valid(bad):
    with pytest.raises(ValueError) as e:
        generation(bad)
    msg = str(e.value)
    assert repr(bad) in msg
    assert all(g in msg for g in GENERATIONS)


@pytest.mark.parametrize("bad", ["4x5", "4x", "abc", "0x4", "-2x2", "x", "4x4x", "4.0x4", "", "32x32", "2x8"])
def test_bad_topology_error_names_value_and_lists_valid(bad):
    with pytest.raises(ValueError) as e:
        Topology.parse("v6e", bad)
    msg = str(e.value)
    assert repr(bad) in msg and "not a v6e topology" in msg
    assert "valid: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16" in msg


def test_example_message_from_the_spec():
    with pytest.raises(
        ValueError,
        match=r"^'4x5' is not a v6e topology; valid: 1x1, 2x2, "
        r"2x4, 4x4, 4x8, 8x8, 8x16, 16x16$",
    ):
        Topology.parse("v6e", "4x5")


@pytest.mark.parametrize(
    ("gen", "bad", "kind"),
    [
        ("v4", "4x4", "3D"),
        ("v5p", "2x2", "3D"),
        ("tpu7x", "8x8", "3D"),
        ("v5e", "2x2x1", "2D"),
        ("v6e", "4x4x4", "2D"),
    ],
)
def test_wrong_rank_says_which_rank(gen, bad, kind):
    with pytest.raises(ValueError) as e:
        Topology.parse(gen, bad)
    msg = str(e.value)
    g = generation(gen)
    assert repr(bad) in msg and f"{g.name} takes {kind} shapes" in msg
    assert g.topologies[0] in msg and g.topologies[-1] in msg


def test_bad_3d_shape_lists_valid():
    with pytest.raises(ValueError) as e:
        Topology.parse("v4", "2x2x3")
    assert "'2x2x3' is not a v4 topology" in str(e.value) and "2x2x1, 2x2x2" in str(e.value)
    with pytest.raises(ValueError, match="'8x4x4' is not a v5p topology"):
        Topology.parse("v5p", "8x4x4")  # Google writes AxBxC with A <= B <= C


def test_topology_normalised():
    assert Topology.parse("v6e", "4X4").name == "4x4"
    assert Topology.parse("v6e", " 4 x 4 ").name == "4x4"
    assert Topology.parse("TPU-V4", "2X2X2").shape == (2, 2, 2)
    assert Topology("TPU-V6E", [4, 4], 4) == Topology("v6e", (4, 4), 4)


@pytest.mark.parametrize(
    ("gen", "name", "cph", "valid"),
    [
        ("v6e", "2x4", 2, "4, 8"),
        ("v6e", "2x4", 1, "4, 8"),
        ("v6e", "4x4", 8, "4"),
        ("v6e", "4x4", 16, "4"),
        ("v4", "2x2x1", 1, "4"),
        ("v4", "2x2x2", 8, "4"),
        ("v5e", "1x1", 4, "1"),
        ("v5e", "2x2", 1, "4"),
        ("v7x", "2x2x1", 8, "4"),
        ("v6e", "2x4", 0, "4, 8"),
        ("v6e", "2x4", -4, "4, 8"),
        ("v6e", "2x4", True, "4, 8"),
        ("v6e", "2x4", 4.0, "4, 8"),
        ("v6e", "2x4", "4", "4, 8"),
    ],
)
def test_impossible_chips_per_host(gen, name, cph, valid):
    with pytest.raises(ValueError) as e:
        Topology.parse(gen, name, chips_per_host=cph)
    msg = str(e.value)
    assert f"chips_per_host={cph!r}" in msg and name in msg and msg.endswith(f"valid: {valid}")
    with pytest.raises(ValueError):
        Topology(gen, tuple(int(d) for d in name.split("x")), cph)


def test_chips_per_host_options_validates_its_input():
    with pytest.raises(ValueError, match="'3x3' is not a v6e topology"):
        chips_per_host_options("v6e", "3x3")
    with pytest.raises(ValueError, match="not a known TPU generation"):
        chips_per_host_options("v9", "2x2")
    with pytest.raises(ValueError, match="not a known TPU generation"):
        valid_topologies("v9")


def test_direct_construction_validates():
    with pytest.raises(ValueError, match=r"\(4, 5\) is not a v6e topology"):
        Topology("v6e", (4, 5), 4)
    with pytest.raises(ValueError, match="not a known TPU generation"):
        Topology("v9", (4, 4), 4)
    with pytest.raises(ValueError, match="not a v4 topology"):
        Topology("v4", (True, 2, 2), 4)


def test_frozen():
    t = Topology.parse("v6e", "4x4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.chips_per_host = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        generation("v6e").cores_per_chip = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        generation("v6e").gke_machine_types[2] = "x"  # type: ignore[index]
    assert hash(t) == hash(Topology("v6e", (4, 4), 4))
    assert hash(generation("v6e")) == hash(generation("TPU-V6E"))


def test_valid_topologies_returns_a_fresh_list():
    shapes = valid_topologies("v6e")
    shapes.append("3x3")
    assert "3x3" not in valid_topologies("v6e")


def test_module_doctests():
    result = doctest.testmod(topo_mod)
    assert result.attempted > 0 and result.failed == 0
