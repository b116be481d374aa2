"""Hardware profiles: device peaks and efficiencies, node size, intra- and inter-node links; YAML, presets."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from paraloom.config.errors import UserError

FLOP_DTYPES = ("fp32", "tf32", "fp16", "bf16")
OP_CLASSES = ("matmul", "conv", "attention", "other")  # as in op_counter.py (kept here so no torch import)
UNITS = {  # kind -> unit -> factor to SI, as exact decimals (KiB, MiB... are binary)
    "FLOP/s": {"": "1", "FLOP/s": "1", "GFLOP/s": "1e9", "TFLOP/s": "1e12", "PFLOP/s": "1e15"},
    "bytes/s": {"": "1", "B/s": "1", "KB/s": "1e3", "MB/s": "1e6", "GB/s": "1e9", "TB/s": "1e12",
                "bit/s": "0.125", "Kbit/s": "125", "Mbit/s": "1.25e5", "Gbit/s": "1.25e8",
                "Tbit/s": "1.25e11"},
    "bytes": {"": "1", "B": "1", "KB": "1e3", "MB": "1e6", "GB": "1e9", "TB": "1e12", "KiB": str(2**10),
              "MiB": str(2**20), "GiB": str(2**30), "TiB": str(2**40)},
    "seconds": {"": "1", "s": "1", "ms": "1e-3", "us": "1e-6", "ns": "1e-9"},
    "number": {"": "1"},
}
_QUANTITY = re.compile(r"^\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")


def _quantity(value: Any, kind: str, where: str, *, positive: bool = True) -> float:
    """A number in SI units, or a string with a unit such as '400 Gbit/s' or '2 us'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        match = _QUANTITY.match(value) if isinstance(value, str) else None
        if match is None or match.group(2) not in UNITS[kind]:
            units = ", ".join(u for u in UNITS[kind] if u)
            raise UserError(f"{where}={value!r} is not a quantity in {kind}; write a number or one with "
                            f"a unit ({units})")
        number = float(Decimal(match.group(1)) * Decimal(UNITS[kind][match.group(2)]))  # 120 us: 0.00012
    if number < 0 or (positive and number == 0) or number != number or number == float("inf"):
        raise UserError(f"{where}={value!r} must be {'positive' if positive else 'zero or more'} and finite")
    return number


def parse_bytes(value: Any, where: str) -> float:
    """A size in bytes, 0 or more: a number, or a string with a unit ('110 KB', '1.5 MiB')."""
    return _quantity(value, "bytes", where, positive=False)


def _fields(raw: Any, valid: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping with keys {', '.join(valid)}, got {type(raw).__name__}")
    unknown = [str(k) for k in raw if k not in valid]
    if unknown:
        raise UserError(f"{where} has unknown field {unknown[0]!r}; valid fields: {', '.join(valid)}")
    return raw


@dataclass(frozen=True)
class Device:
    """One accelerator: peak FLOP/s per dtype, achieved fraction by op class, memory bandwidth, capacity."""

    name: str
    peak_flops: dict[str, float]  # FLOP/s per dtype: "fp32" (required), "tf32", "fp16", "bf16"
    efficiency: dict[str, float]  # achieved fraction of peak by op class: matmul, conv, attention, other
    mem_bandwidth: float  # bytes/s
    mem_capacity: float  # bytes
    # per dtype, how many times fewer multiplies the device's convolution library needs for a 3x3
    # stride-1 convolution (Winograd's algorithm) than its direct FLOPs; absent: direct convolution
    winograd: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        _fields(self.winograd, FLOP_DTYPES, f"{where} winograd")
        gains = {k: _quantity(v, "number", f"{where} winograd.{k}") for k, v in self.winograd.items()}
        if any(v < 1 for v in gains.values()):
            raise UserError(f"{where} winograd factors must be at least 1 (the FLOPs are divided by them)")
        object.__setattr__(self, "winograd", gains)
        _fields(self.peak_flops, FLOP_DTYPES, f"{where} peak_flops")
        if "fp32" not in self.peak_flops:
            raise UserError(f"{where} peak_flops needs an fp32 entry")
        _fields(self.efficiency, OP_CLASSES, f"{where} efficiency")
        missing = [c for c in OP_CLASSES if c not in self.efficiency]
        if missing:
            raise UserError(f"{where} efficiency needs every op class; add {', '.join(missing)} "
                            "(fractions of peak, 0 < value <= 1)")
        peaks = {k: _quantity(v, "FLOP/s", f"{where} peak_flops.{k}") for k, v in self.peak_flops.items()}
        effs = {k: _quantity(v, "number", f"{where} efficiency.{k}") for k, v in self.efficiency.items()}
        bad = [k for k, v in effs.items() if v > 1]
        if bad:
            raise UserError(f"{where} efficiency.{bad[0]}={effs[bad[0]]} must lie in (0, 1]: "
                            "it is a fraction of peak")
        object.__setattr__(self, "peak_flops", peaks)
        object.__setattr__(self, "efficiency", effs)
        bandwidth = _quantity(self.mem_bandwidth, "bytes/s", f"{where} mem_bandwidth")
        object.__setattr__(self, "mem_bandwidth", bandwidth)
        capacity = _quantity(self.mem_capacity, "bytes", f"{where} mem_capacity")
        object.__setattr__(self, "mem_capacity", capacity)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise UserError(f"device {self.name!r} has no {dtype} peak; choose a dtype in "
                            f"{', '.join(self.peak_flops)} or add peak_flops.{dtype} to the profile")
        return self.peak_flops[dtype]

    def achieved_flops(self, dtype: str, op_class: str) -> float:
        """FLOP/s this device reaches on `op_class` in `dtype`: peak times the class's efficiency."""
        return self.peak(dtype) * self.efficiency[op_class]


@dataclass(frozen=True)
class Link:
    """A link in the alpha-beta model: time(n bytes) = latency + n / bandwidth."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds (alpha)

    def __post_init__(self) -> None:
        where = f"link {self.name!r}"
        object.__setattr__(self, "bandwidth", _quantity(self.bandwidth, "bytes/s", f"{where} bandwidth"))
        latency = _quantity(self.latency, "seconds", f"{where} latency", positive=False)
        object.__setattr__(self, "latency", latency)


HARDWARE_FIELDS = ("name", "device", "devices_per_node", "nics_per_node", "intra", "inter", "constants")


@dataclass(frozen=True)
class Hardware:
    """A cluster's building block: `devices_per_node` devices joined by `intra`; nodes joined by `inter`."""

    name: str
    device: Device
    devices_per_node: int
    intra: Link  # device to device inside a node
    inter: Link  # one network adapter's link between nodes
    constants: dict[str, float] = field(default_factory=dict)  # calibrated extras, e.g. "step_overhead_s"
    nics_per_node: int = 1  # network adapters per node (InfiniBand presets: one per device)

    def __post_init__(self) -> None:
        for key in ("devices_per_node", "nics_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"hardware {self.name!r} {key}={value!r} must be a positive whole number")
        if not isinstance(self.constants, dict) or not all(isinstance(k, str) for k in self.constants):
            raise UserError(f"hardware {self.name!r} constants must map names to numbers")
        constants = {k: _quantity(v, "number", f"hardware {self.name!r} constants.{k}", positive=False)
                     for k, v in self.constants.items()}
        object.__setattr__(self, "constants", constants)

    def achieved_flops(self, dtype: str, op_class: str) -> float:
        """FLOP/s of `op_class` in `dtype`: the measured rate (`flops.<dtype>.<class>`, from
        `paraloom calibrate --device`) where the profile has one, else the device's peak x efficiency."""
        return self.constants.get(f"flops.{dtype}.{op_class}") or self.device.achieved_flops(dtype, op_class)

    def to_dict(self) -> dict[str, Any]:
        device = {k: getattr(self.device, k) for k in DEVICE_FIELDS}
        return {"name": self.name,
                "device": {k: dict(v) if isinstance(v, dict) else v for k, v in device.items()},
                "devices_per_node": self.devices_per_node, "nics_per_node": self.nics_per_node,
                "intra": {k: getattr(self.intra, k) for k in LINK_FIELDS},
                "inter": {k: getattr(self.inter, k) for k in LINK_FIELDS},
                "constants": dict(self.constants)}

    def to_yaml(self) -> str:
        head = "# paraloom hardware profile; SI units: FLOP/s, bytes/s, bytes, seconds\n"
        return head + yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "hardware profile") -> Hardware:
        """Read a profile; device and links may be preset names, or mappings with `preset:` plus overrides."""
        from paraloom.config.yaml_io import parse_yaml

        return _hardware(parse_yaml(text, source), source)


DEVICE_FIELDS = ("name", "peak_flops", "efficiency", "mem_bandwidth", "mem_capacity", "winograd")
OPTIONAL_FIELDS = {"winograd": dict}  # a device mapping may leave these out
LINK_FIELDS = ("name", "bandwidth", "latency")


@functools.cache
def _presets(filename: str) -> dict[str, Any]:
    return yaml.safe_load((resources.files("paraloom.perfmodel") / "presets" / filename).read_text())


def _device_names() -> list[str]:
    return list(_presets("devices.yaml"))


def _link_entries() -> dict[str, dict[str, Any]]:
    links = _presets("links.yaml")
    return {**links["intra"], **links["network"]}


def _canonical_link(name: str) -> str:
    return _presets("links.yaml")["aliases"].get(name, name)


def device_preset(name: str) -> Device:
    entry = _presets("devices.yaml").get(name)
    if entry is None:
        raise UserError(f"device preset {name!r} is not known; choose one of: {', '.join(_device_names())}")
    return Device(name=name, **{k: v for k, v in entry.items() if k != "node"})


def device_preset_names() -> list[str]:
    return _device_names()


def preset_node(name: str) -> dict[str, Any]:
    """The usual node of device preset `name`: {"devices_per_node": ..., "intra": link preset name}."""
    device_preset(name)  # a clear error for an unknown name
    return dict(_presets("devices.yaml")[name].get("node", {}))


def link_preset(name: str) -> Link:
    entry = _link_entries().get(_canonical_link(name))
    if entry is None:
        raise UserError(f"link preset {name!r} is not known; choose one of: {', '.join(_link_entries())}")
    return Link(name=_canonical_link(name), bandwidth=entry["bandwidth"], latency=entry["latency"])


def _from_preset(raw: Any, where: str, cls: type, fields: tuple[str, ...], preset, names: list[str],
                 default_name: str):
    """A preset's name, or a mapping of `fields` with an optional `preset:` whose values it overrides
    (a table such as `efficiency: {matmul: 0.7}` only the keys it names)."""
    if isinstance(raw, str):
        return preset(raw)
    raw = dict(_fields(raw, ("preset", *fields), where))
    base = preset(raw.pop("preset")) if "preset" in raw else None
    values = {k: getattr(base, k) for k in fields} if base else {"name": default_name}
    for key, value in raw.items():  # a table (efficiency, peak_flops, winograd) overrides key by key
        inherited = values.get(key)
        merge = isinstance(inherited, dict) and isinstance(value, dict)
        values[key] = {**inherited, **value} if merge else value
    for key, default in OPTIONAL_FIELDS.items():
        if key in fields:
            values.setdefault(key, default())
    missing = [k for k in fields if k not in values]
    if missing:
        raise UserError(f"{where} needs {', '.join(missing)} (or preset: {', '.join(names)})")
    return cls(**values)


def _device(raw: Any, where: str) -> Device:
    return _from_preset(raw, where, Device, DEVICE_FIELDS, device_preset, _device_names(), "custom")


def _link(raw: Any, where: str) -> Link:
    return _from_preset(raw, where, Link, LINK_FIELDS, link_preset, list(_link_entries()),
                        where.rsplit(" ", 1)[-1])


def network_nics(network: str, devices_per_node: int) -> int:
    """Network adapters per node for network preset `network`: one per device where the preset
    says so (InfiniBand, rail-optimised as DGX nodes are), else one per node."""
    entry = _presets("links.yaml")["network"].get(_canonical_link(network), {})
    return devices_per_node if entry.get("one_per_device", False) else 1


def _preset_name(raw: Any) -> str | None:
    """The preset a field names: itself when a string, its `preset:` key when a mapping."""
    return raw if isinstance(raw, str) else raw.get("preset") if isinstance(raw, dict) else None


def _hardware(raw: Any, source: str, *, custom: bool = True) -> Hardware:
    """A profile from its fields. A device or link given as a mapping with `preset:` inherits all the
    preset has (the device's usual node, the network's adapter per device); a custom profile whose
    devices share fewer network adapters than they are, without saying so, is warned about."""
    raw = _fields(raw, HARDWARE_FIELDS, source)
    for key in ("device", "inter"):
        if key not in raw:
            raise UserError(f"{source} needs a {key!r} field (a preset name or a mapping)")
    device = _device(raw["device"], f"{source} device")
    device_name = _preset_name(raw["device"])
    node = _presets("devices.yaml").get(device_name, {}).get("node", {}) if device_name else {}
    devices_per_node = raw.get("devices_per_node", node.get("devices_per_node"))
    intra = raw.get("intra", node.get("intra"))
    if devices_per_node is None or intra is None:
        raise UserError(f"{source} needs devices_per_node and intra (a device preset name supplies both)")
    inter = _link(raw["inter"], f"{source} inter")
    network = _preset_name(raw["inter"])
    nics = raw.get("nics_per_node", network_nics(network, devices_per_node) if network else 1)
    hw = Hardware(name=str(raw.get("name", "custom")), device=device, devices_per_node=devices_per_node,
                  intra=_link(intra, f"{source} intra"), inter=inter, constants=raw.get("constants") or {},
                  nics_per_node=nics)
    if custom and "nics_per_node" not in raw and hw.nics_per_node < hw.devices_per_node:
        print(f"paraloom: note: {source}: {hw.devices_per_node} devices per node share "
              f"{hw.nics_per_node} network adapter{'s' if hw.nics_per_node > 1 else ''} of "
              f"{hw.inter.bandwidth * 8 / 1e9:g} Gbit/s; set nics_per_node if each has its own",
              file=sys.stderr)
    return hw


def preset_names() -> list[str]:
    """Hardware presets, `<device>-<network>`: every device preset on every network preset."""
    return [f"{d}-{n}" for d in _presets("devices.yaml") for n in _presets("links.yaml")["network"]]


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A preset such as "h100-ib-ndr" (aliases: "a100-hdr"), or a YAML profile file."""
    text = str(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            content = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read hardware profile {text!r}: {exc.__class__.__name__}") from None
        return Hardware.from_yaml(content, source=f"hardware profile {text!r}")
    for device in _presets("devices.yaml"):
        network = text.removeprefix(f"{device}-")
        if network != text and _canonical_link(network) in _presets("links.yaml")["network"]:
            name = f"{device}-{_canonical_link(network)}"
            return _hardware({"name": name, "device": device, "inter": network}, f"hardware preset {text!r}",
                             custom=False)
    raise UserError(f"hardware {text!r} is neither a YAML file nor a preset; presets: "
                    f"{', '.join(preset_names())}")


__all__ = ["Device", "Hardware", "Link", "device_preset", "device_preset_names", "link_preset",
           "load_hardware", "network_nics", "parse_bytes", "preset_names", "preset_node"]
