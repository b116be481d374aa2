"""Hardware profiles: presets from spec sheets, units, YAML round trips, one-line errors."""

import dataclasses

import pytest

from paraloom.config.errors import UserError
from paraloom.perfmodel.hardware import (
    Device,
    Hardware,
    Link,
    device_preset,
    link_preset,
    load_hardware,
    preset_names,
)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_round_trips(name):
    hw = load_hardware(name)
    assert hw.name == name and name.startswith(f"{hw.device.name}-")
    assert Hardware.from_yaml(hw.to_yaml()) == hw


def test_presets_cover_the_usual_gpus_and_networks():
    for device in ("h100", "a100", "v100"):
        for network in ("1gbe", "10gbe", "25gbe", "100gbe", "ib-hdr", "ib-ndr"):
            assert f"{device}-{network}" in preset_names()


def test_preset_values_are_the_published_ones():
    h100 = device_preset("h100")
    assert h100.peak_flops["bf16"] == 989e12 and h100.peak_flops["fp32"] == 67e12
    assert h100.mem_bandwidth == 3.35e12 and h100.mem_capacity == 80 * 2**30
    a100, v100 = device_preset("a100"), device_preset("v100")
    assert a100.peak_flops["bf16"] == 312e12 and a100.peak_flops["fp32"] == 19.5e12
    assert v100.peak_flops["fp16"] == 125e12 and v100.peak_flops["fp32"] == 15.7e12
    assert v100.mem_bandwidth == 900e9 and v100.mem_capacity == 32 * 2**30
    assert link_preset("nvlink4").bandwidth == 450e9 and link_preset("nvlink3").bandwidth == 300e9
    assert link_preset("nvlink2").bandwidth == 150e9
    assert link_preset("ib-ndr").bandwidth == 400e9 / 8 and link_preset("ib-hdr").bandwidth == 200e9 / 8
    gbits = (1, 10, 25, 100)
    assert [link_preset(f"{g}gbe").bandwidth for g in gbits] == [g * 1e9 / 8 for g in gbits]
    assert 1e-6 <= link_preset("ib-ndr").latency <= 5e-6 and 20e-6 <= link_preset("10gbe").latency <= 50e-6


def test_the_older_smaller_and_other_vendors_parts_are_there_too():
    """Data-sheet figures (each cited in presets/devices.yaml and links.yaml)."""
    expected = {"p100": (10.6e12, 732e9, 16), "k80": (4.365e12, 240e9, 12), "v100-pcie": (14e12, 900e9, 32),
                "t4": (8.1e12, 320e9, 16), "a10": (31.2e12, 600e9, 24), "l4": (30.3e12, 300e9, 24),
                "mi300x": (163.4e12, 5.3e12, 192)}
    for name, (fp32, bandwidth, gib) in expected.items():
        d = device_preset(name)
        assert (d.peak_flops["fp32"], d.mem_bandwidth, d.mem_capacity) == (fp32, bandwidth, gib * 2**30)
    assert device_preset("mi300x").peak_flops["bf16"] == 1307.4e12
    assert "bf16" not in device_preset("t4").peak_flops
    assert link_preset("nvlink1").bandwidth == 80e9 and link_preset("infinity-fabric3").bandwidth == 448e9
    assert [link_preset(f"{g}gbe").bandwidth for g in (50, 200, 400)] == [g * 1e9 / 8 for g in (50, 200, 400)]
    assert link_preset("edr").bandwidth == 100e9 / 8 and link_preset("ib-fdr").bandwidth == 56e9 / 8
    assert load_hardware("p100-ib-edr").intra.name == "nvlink1"
    assert load_hardware("mi300x-ib-ndr").nics_per_node == 8 and load_hardware("t4-ib-edr").nics_per_node == 1


def test_presets_name_a_node():
    hw = load_hardware("h100-ib-ndr")
    assert hw.devices_per_node == 8 and hw.intra.name == "nvlink4" and hw.inter.name == "ib-ndr"
    assert hw.nics_per_node == 8  # one InfiniBand adapter per GPU, as in DGX H100
    v100 = load_hardware("v100-25gbe")
    assert v100.nics_per_node == 1 and v100.intra.name == "nvlink2"
    assert load_hardware("a100-hdr") == load_hardware("a100-ib-hdr")  # alias
    assert hw.constants == {}


def test_custom_profile_with_units_presets_and_constants_round_trips(tmp_path):
    text = """
name: lab
device: {preset: a100, mem_capacity: 40 GiB, efficiency: {matmul: 0.7, conv: 0.5, attention: 0.4, other: 0.1}}
devices_per_node: 4
intra: pcie4
inter: {name: lab-net, bandwidth: 400 Mbit/s, latency: 120 us}
constants: {step_overhead_s: 0.002}
"""
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    hw = load_hardware(str(path))
    assert hw.device.mem_capacity == 40 * 2**30 and hw.device.peak_flops["bf16"] == 312e12
    assert hw.device.efficiency["matmul"] == 0.7
    assert hw.inter == Link(name="lab-net", bandwidth=50e6, latency=120e-6)
    assert hw.intra.bandwidth == 31.5e9 and hw.nics_per_node == 1
    assert hw.constants == {"step_overhead_s": 0.002}
    again = tmp_path / "again.yaml"
    again.write_text(hw.to_yaml())
    assert load_hardware(again) == hw


def test_device_throughput_helpers():
    v100 = device_preset("v100")
    assert v100.achieved_flops("fp16", "matmul") == 125e12 * v100.efficiency["matmul"]
    with pytest.raises(UserError, match="no bf16 peak; choose a dtype in fp32, fp16"):
        v100.peak("bf16")


def test_dataclasses_check_their_fields():
    d = device_preset("h100")
    with pytest.raises(UserError, match="must lie in"):
        dataclasses.replace(d, efficiency={**d.efficiency, "matmul": 1.5})
    with pytest.raises(UserError, match="needs every op class; add other"):
        Device("x", {"fp32": 1e12}, {"matmul": 0.5, "conv": 0.5, "attention": 0.5}, 1e12, 1e9)
    with pytest.raises(UserError, match="must be zero or more"):
        Link("x", 1e9, -1e-6)
    with pytest.raises(UserError, match="devices_per_node=0 must be a positive whole number"):
        dataclasses.replace(load_hardware("h100-ib-ndr"), devices_per_node=0)


@pytest.mark.parametrize(("text", "message"), [
    ("device: h100\ninter: ib-ndr\ncolour: red", "unknown field 'colour'; valid fields: name, device"),
    ("device: h100\ninter: {bandwidth: 10 furlongs/s, latency: 1 us}", "is not a quantity in bytes/s"),
    ("device: h100\ninter: {bandwidth: -5, latency: 1 us}", "bandwidth=-5 must be positive"),
    ("device: h100\ninter: {bandwidth: -5 GB/s, latency: 1 us}", "is not a quantity in bytes/s"),
    ("device: h100\ninter: {bandwidth: 0, latency: 1 us}", "must be positive"),
    ("device: h100\ninter: {bandwidth: 1 Gbit/s}", "needs latency"),
    ("device: {preset: h100, efficiency: {matmul: 2, conv: 1, attention: 1, other: 1}}\ninter: 1gbe",
     "efficiency.matmul=2.0 must lie in"),
    ("device: {preset: h100, peak_flops: {fp64: 1}}\ninter: 1gbe", "unknown field 'fp64'"),
    ("device: {preset: h100, hbm: 3}\ninter: 1gbe", "unknown field 'hbm'"),
    ("device: tpu\ninter: 1gbe", "device preset 'tpu' is not known; choose one of: h100, h200, a100, v100"),
    ("device: h100\ninter: carrier-pigeon", "link preset 'carrier-pigeon' is not known"),
    ("device: h100", "needs a 'inter' field"),
    ("device: {peak_flops: {fp32: 1}}\ninter: 1gbe", "needs efficiency, mem_bandwidth, mem_capacity"),
    ("device: {name: x, peak_flops: {fp32: 1}, efficiency: {matmul: 1, conv: 1, attention: 1, other: 1}, "
     "mem_bandwidth: 1, mem_capacity: 1}\ninter: 1gbe", "needs devices_per_node and intra"),
    ("device: h100\ninter: 1gbe\nnics_per_node: 1.5", "nics_per_node=1.5 must be a positive whole number"),
    ("device: h100\ninter: 1gbe\nconstants: {step_overhead_s: soon}", "constants.step_overhead_s"),
    ("device: h100\ninter: [1gbe", "is not valid YAML (line"),
    ("- h100", "must be a mapping"),
])
def test_invalid_fields_give_one_line_errors(text, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        Hardware.from_yaml(text)
    assert "\n" not in str(err.value)


def test_unknown_preset_or_missing_file():
    with pytest.raises(UserError, match="neither a YAML file nor a preset; presets: h100-1gbe"):
        load_hardware("tpu-v5")
    with pytest.raises(UserError, match="cannot read hardware profile"):
        load_hardware("/nonexistent/cluster.yaml")


def test_a_mapping_inherits_everything_its_preset_has(capsys):
    """`device: {preset: ...}` keeps the preset's node (devices, NVLink); `inter: {preset: ib-...}`
    keeps one adapter per device, as the plain names do."""
    hw = Hardware.from_yaml("device: {preset: h100, mem_capacity: 40 GiB}\n"
                            "inter: {preset: ib-hdr, latency: 5 us}")
    plain = load_hardware("h100-ib-hdr")
    assert (hw.devices_per_node, hw.intra, hw.nics_per_node) == (8, plain.intra, 8)
    assert hw.inter.bandwidth == plain.inter.bandwidth and hw.inter.latency == 5e-6
    assert hw.device.mem_capacity == 40 * 2**30 and hw.device.peak_flops == plain.device.peak_flops
    assert capsys.readouterr().err == ""


def test_a_mapping_overrides_a_table_of_its_preset_key_by_key():
    hw = Hardware.from_yaml("device: {preset: p100, efficiency: {conv: 0.3},\n"
                            "         peak_flops: {fp16: 20 TFLOP/s}}\ninter: ib-edr")
    plain = load_hardware("p100-ib-edr").device
    assert hw.device.efficiency == {**plain.efficiency, "conv": 0.3}
    assert hw.device.peak_flops == {**plain.peak_flops, "fp16": 20e12}
    assert hw.device.winograd == plain.winograd
    with pytest.raises(UserError, match="efficiency.conv=1.5 must lie in"):
        Hardware.from_yaml("device: {preset: p100, efficiency: {conv: 1.5}}\ninter: ib-edr")


def test_a_custom_profile_sharing_one_adapter_among_its_devices_says_so(capsys):
    Hardware.from_yaml("name: lab\ndevice: h100\ninter: 100gbe")
    err = capsys.readouterr().err
    assert "8 devices per node share 1 network adapter of 100 Gbit/s; set nics_per_node" in err
    Hardware.from_yaml("device: h100\ninter: 100gbe\nnics_per_node: 1")  # said: no note
    load_hardware("h100-100gbe")  # a preset says what it is
    Hardware.from_yaml("device: h100\ninter: ib-ndr")  # one adapter per device
    assert capsys.readouterr().err == ""
