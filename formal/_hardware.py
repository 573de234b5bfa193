"""Hardware presets for the step-time model (``formal._steptime``), from the vendors' datasheets.

Every figure is per GPU: dense FP16/BF16 tensor-core FLOP/s (no structured sparsity), HBM
bandwidth, NVLink bandwidth per direction (NVIDIA quotes bidirectional totals: half of it is one
direction), the scale-out network per GPU (DGX/HGX systems give each GPU its own InfiniBand or
RoCE NIC), and host links. Nodes hold 8 GPUs as in DGX-1, DGX A100, DGX H100/H200 and DGX B200.
A site's own figures come from ``--hardware FILE.toml`` (``load_hardware_toml``): every key is
checked, and a bad one is refused with an ``InputError`` naming it.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from formal._input import printable
from formal.errors import InputError

GB = 10**9
TERA = 10**12


@dataclass(frozen=True)
class Hardware:
    """One GPU type in its node. Rates in bytes/s and FLOP/s (floats: time is not exact)."""

    name: str
    peak_flops: float  # dense FP16/BF16 tensor FLOP/s per GPU
    memory_bandwidth: float  # HBM bytes/s per GPU
    device_memory: int  # bytes
    node_size: int  # GPUs per node joined by NVLink
    intra_node_bandwidth: float  # NVLink bytes/s per GPU, one direction
    inter_node_bandwidth: float  # scale-out network bytes/s per GPU, one direction
    host_bandwidth: float  # PCIe bytes/s per GPU, one direction
    host_memory_bandwidth: float  # host DRAM bytes/s per GPU (CPU optimizer under offload)
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(value, str):
                    raise InputError(f"hardware {f.name}={printable(repr(value), 60)}: must be a string")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"hardware {f.name}={value!r}: must be a number")
            if not math.isfinite(value) or value <= 0:
                raise InputError(f"hardware {f.name}={value!r}: must be a positive finite number")
        if not isinstance(self.node_size, int):
            raise InputError(f"hardware node_size={self.node_size!r}: must be a whole number")


# Host links: PCIe 3.0 / 4.0 / 5.0 x16 carry about 16 / 32 / 64 GB/s per direction (PCI-SIG).
# Host DRAM per GPU: the node's CPU memory bandwidth over its 8 GPUs (DGX A100: 2 AMD EPYC 7742,
# 8 channels DDR4-3200 each, 409.6 GB/s; DGX H100: 2 Xeon 8480C, 8 channels DDR5-4800 each,
# 614 GB/s; DGX-1: 2 Xeon E5-2698 v4, 4 channels DDR4-2400 each, 154 GB/s).
PRESETS: dict[str, Hardware] = {
    "v100-32gb": Hardware(
        "v100-32gb",
        peak_flops=125 * TERA,
        memory_bandwidth=900 * GB,
        device_memory=32 * GB,
        node_size=8,
        intra_node_bandwidth=150 * GB,
        inter_node_bandwidth=6.25 * GB,
        host_bandwidth=16 * GB,
        host_memory_bandwidth=19.2 * GB,
        source="NVIDIA V100 Tensor Core GPU datasheet (SXM2: 125 TFLOPS tensor, 900 GB/s HBM2, NVLink "
        "300 GB/s); DGX-1 (8 V100, 4x 100 Gb/s EDR InfiniBand per node: 6.25 GB/s per GPU)",
    ),
    "a100-40gb": Hardware(
        "a100-40gb",
        peak_flops=312 * TERA,
        memory_bandwidth=1555 * GB,
        device_memory=40 * GB,
        node_size=8,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        host_bandwidth=32 * GB,
        host_memory_bandwidth=51.2 * GB,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM 40GB: 312 TFLOPS BF16 dense, 1,555 GB/s HBM2, "
        "NVLink 600 GB/s); DGX A100 (8x 200 Gb/s HDR InfiniBand, one per GPU: 25 GB/s)",
    ),
    "a100-80gb": Hardware(
        "a100-80gb",
        peak_flops=312 * TERA,
        memory_bandwidth=2039 * GB,
        device_memory=80 * GB,
        node_size=8,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        host_bandwidth=32 * GB,
        host_memory_bandwidth=51.2 * GB,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, "
        "NVLink 600 GB/s); DGX A100 (8x 200 Gb/s HDR InfiniBand, one per GPU: 25 GB/s)",
    ),
    "h100-80gb": Hardware(
        "h100-80gb",
        peak_flops=989 * TERA,
        memory_bandwidth=3350 * GB,
        device_memory=80 * GB,
        node_size=8,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        host_bandwidth=64 * GB,
        host_memory_bandwidth=76.8 * GB,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, NVLink "
        "900 GB/s); DGX H100 (8x 400 Gb/s ConnectX-7, one per GPU: 50 GB/s)",
    ),
    "h200": Hardware(
        "h200",
        peak_flops=989 * TERA,
        memory_bandwidth=4800 * GB,
        device_memory=141 * GB,
        node_size=8,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        host_bandwidth=64 * GB,
        host_memory_bandwidth=76.8 * GB,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 141 GB HBM3e at 4.8 TB/s, "
        "NVLink 900 GB/s); DGX H200 (8x 400 Gb/s ConnectX-7, one per GPU: 50 GB/s)",
    ),
    "b200": Hardware(
        "b200",
        peak_flops=2250 * TERA,
        memory_bandwidth=8000 * GB,
        device_memory=180 * GB,
        node_size=8,
        intra_node_bandwidth=900 * GB,
        inter_node_bandwidth=50 * GB,
        host_bandwidth=64 * GB,
        host_memory_bandwidth=76.8 * GB,
        source="NVIDIA DGX B200 datasheet (8 B200, 1,440 GB HBM3e at 64 TB/s, 72 PFLOPS FP8 training = "
        "2.25 PFLOPS BF16 dense per GPU, NVLink 5 1.8 TB/s per GPU; 8x 400 Gb/s ConnectX-7: 50 GB/s)",
    ),
}

# --hardware FILE.toml: key -> (field, multiplier to the field's unit)
_TOML_KEYS: dict[str, tuple[str, float]] = {
    "name": ("name", 1),
    "peak_tflops": ("peak_flops", TERA),
    "memory_bandwidth_gb_s": ("memory_bandwidth", GB),
    "device_memory_gb": ("device_memory", GB),
    "node_size": ("node_size", 1),
    "nvlink_gb_s": ("intra_node_bandwidth", GB),
    "network_gb_s": ("inter_node_bandwidth", GB),
    "pcie_gb_s": ("host_bandwidth", GB),
    "host_memory_bandwidth_gb_s": ("host_memory_bandwidth", GB),
}


def hardware_of(text: str) -> Hardware:
    """A preset name, or a path ending in .toml (``load_hardware_toml``)."""
    if text in PRESETS:
        return PRESETS[text]
    if text.endswith(".toml"):
        return load_hardware_toml(Path(text))
    raise InputError(f"--hardware {printable(text, 200)!r}: not a preset ({', '.join(PRESETS)}) nor a .toml file")


def load_hardware_toml(path: Path) -> Hardware:
    """``base = "<preset>"`` (optional) and any of the keys of ``_TOML_KEYS`` (GB = 1e9 bytes,
    per GPU, one direction); without ``base`` every key is required."""
    shown = printable(str(path), 200)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise InputError(f"--hardware {shown}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise InputError(f"--hardware {shown}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"--hardware {shown}: not valid TOML ({printable(str(err), 200)})") from None
    base_name = data.pop("base", None)
    unknown = sorted(set(data) - set(_TOML_KEYS))
    if unknown:
        key = printable(unknown[0], 60)
        raise InputError(f"--hardware {shown}: unknown key '{key}' (known: base, {', '.join(_TOML_KEYS)})")
    values: dict[str, object] = {}
    for key, raw in data.items():
        fname, scale = _TOML_KEYS[key]
        if fname == "name":
            if not isinstance(raw, str):
                raise InputError(f"--hardware {shown}: name must be a string")
            values[fname] = raw
            continue
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise InputError(f"--hardware {shown}: {key}={printable(repr(raw), 60)} must be a number")
        if fname == "node_size" and not isinstance(raw, int):
            raise InputError(f"--hardware {shown}: node_size={printable(repr(raw), 60)} must be a whole number")
        if not math.isfinite(raw) or raw <= 0:
            raise InputError(f"--hardware {shown}: {key}={raw!r} must be positive")
        scaled = raw * scale
        values[fname] = int(scaled) if fname in ("node_size", "device_memory") else float(scaled)
    values.setdefault("name", path.stem)
    values["source"] = f"{shown} (user)"
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PRESETS:
            base = printable(repr(base_name), 60)
            raise InputError(f"--hardware {shown}: base={base} is not a preset ({', '.join(PRESETS)})")
        return replace(PRESETS[base_name], **values)  # type: ignore[arg-type]
    missing = [k for k, (f, _) in _TOML_KEYS.items() if f not in values]
    if missing:
        raise InputError(f'--hardware {shown}: missing {missing[0]!r} (or give base = "<preset>")')
    return Hardware(**values)  # type: ignore[arg-type]


# The preset assumed when no hardware is named (``plan`` without ``--hardware``), by device
# memory: the first preset in this order whose memory is at least the device's (the largest
# beyond them). 80 GB is an A100 80GB, not an H100: the planner's figures before the calibrated
# model were NVIDIA Selene's DGX A100 (Narayanan et al. 2021), and most published runs the
# constants are fitted on are A100 runs (docs/steptime.md, "Calibration"), so the assumption is
# the hardware the model is best checked on. Its name is printed wherever it is used.
_ASSUMED_ORDER = ("v100-32gb", "a100-40gb", "a100-80gb", "h200", "b200")


def assumed_hardware(device_memory: int) -> Hardware:
    """The preset assumed for devices of ``device_memory`` bytes (``_ASSUMED_ORDER``), with
    that memory."""
    chosen = next(
        (PRESETS[n] for n in _ASSUMED_ORDER if PRESETS[n].device_memory >= device_memory),
        PRESETS[_ASSUMED_ORDER[-1]],
    )
    return replace(chosen, device_memory=device_memory)
