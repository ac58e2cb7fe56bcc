"""GPU presets and the parsers for `--gpus 8xH100`, `--cpu-memory 1TB`, `--cpu-bandwidth 300GB/s`.

Owns: the device table the planner reads (memory and HBM bandwidth per GPU model) and the
size/bandwidth string parsers shared by `plan`, `serve` and `deploy`.

Invariants:
- `memory_bytes` is the total the driver reports (nvidia-smi "MiB" figure), not the marketing
  number: an "80GB" H100 has 81,559 MiB. `gpu_memory_utilization` is applied by the planner.
- Memory sizes ("1TB", "512GB") are binary (GiB/TiB), as DIMMs and nvidia-smi count them;
  bandwidths ("300GB/s") are decimal, as datasheets quote them.
- No torch import.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

MiB = 2**20


# Share of host RAM the CPU experts may take; the rest is the OS, page cache and pinned buffers.
CPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int  # total device memory as the driver reports it
    bandwidth: float  # HBM/GDDR bytes per second (datasheet peak)
    nvlink: bool  # GPUs of one host talk over NVLink/NVSwitch (else PCIe)
    fp8: bool  # FP8 tensor cores (Hopper, Ada, Blackwell)
    bandwidth_assumed: bool = False  # a GPU given by its memory only: `bandwidth` is a guess

    def to_dict(self) -> dict:
        return asdict(self)


# Datasheet bandwidths; memory as nvidia-smi reports it for the SXM/PCIe part named.
GPU_PRESETS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 81559 * MiB, 3.35e12, True, True),  # H100 SXM5 80GB
    "H200": GpuSpec("H200", 143771 * MiB, 4.8e12, True, True),  # H200 SXM 141GB
    "H20": GpuSpec("H20", 97871 * MiB, 4.0e12, True, True),  # H20 96GB
    "B200": GpuSpec("B200", 183359 * MiB, 8.0e12, True, True),  # B200 180GB
    "A100": GpuSpec("A100", 81920 * MiB, 2.039e12, True, False),  # A100 SXM4 80GB
    "L20": GpuSpec("L20", 46068 * MiB, 0.864e12, False, True),  # L20 48GB
    "RTX4090": GpuSpec("RTX4090", 24564 * MiB, 1.008e12, False, True),  # GeForce RTX 4090 24GB
    "RTX6000PRO": GpuSpec("RTX6000PRO", 97887 * MiB, 1.792e12, False, True),  # RTX PRO 6000 96GB
    # H100 NVL 94GB HBM3, 3.9 TB/s; PCIe cards sold in NVLink-bridged pairs (600 GB/s), which
    # is how the guides run them: NVLink (more than 2 talk over PCIe between the pairs)
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet, "H100 NVL" column)
    "H100NVL": GpuSpec("H100NVL", 95830 * MiB, 3.9e12, True, True),
    # H100 PCIe 80GB HBM2e, 2.0 TB/s (same datasheet, "H100 PCIe" column)
    "H100PCIE": GpuSpec("H100PCIE", 81559 * MiB, 2.0e12, False, True),
    # L40S 48GB GDDR6, 864 GB/s: https://www.nvidia.com/en-us/data-center/l40s/
    "L40S": GpuSpec("L40S", 46068 * MiB, 0.864e12, False, True),
    # GeForce RTX 5090 32GB GDDR7, 1792 GB/s:
    # https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/
    "RTX5090": GpuSpec("RTX5090", 32607 * MiB, 1.792e12, False, True),
    # GH200 Grace Hopper, 96GB HBM3 at 4.0 TB/s (the 144GB HBM3e part: 4.9 TB/s), one GPU per
    # superchip: https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/
    # NOTE: memory = the datasheet GB as GiB (driver figure not checked), as for the parts below
    "GH200": GpuSpec("GH200", 96 * 1024 * MiB, 4.0e12, False, True),
    "GH200-144GB": GpuSpec("GH200-144GB", 144 * 1024 * MiB, 4.9e12, False, True),
    # B300 (Blackwell Ultra) 288GB HBM3e, 8 TB/s, NVLink 5 (HGX B300):
    # https://www.nvidia.com/en-us/data-center/hgx/ (HGX B300 specifications, per GPU)
    "B300": GpuSpec("B300", 288 * 1024 * MiB, 8.0e12, True, True),
}
_ALIASES = {
    "H100": ("H100", "H10080GB", "H100SXM", "H800"),
    "H200": ("H200", "H200141GB"),
    "H20": ("H20", "H2096GB"),
    "B200": ("B200", "B200180GB"),
    "A100": ("A100", "A10080GB", "A800"),
    "L20": ("L20", "L2048GB"),
    "RTX4090": ("RTX4090", "4090", "GEFORCERTX4090"),
    "RTX6000PRO": ("RTX6000PRO", "RTXPRO6000", "PRO6000", "RTXPRO6000BLACKWELL"),
    "H100NVL": ("H100NVL", "H100NVL94GB", "H10094GB"),
    "H100PCIE": ("H100PCIE", "H100PCIE80GB"),
    "L40S": ("L40S", "L40S48GB"),
    "RTX5090": ("RTX5090", "5090", "GEFORCERTX5090"),
    "GH200": ("GH200", "GH20096GB", "GH200480GB"),
    "GH200-144GB": ("GH200144GB", "GH200624GB"),
    "B300": ("B300", "B300288GB", "B300SXM"),
}
_LOOKUP = {alias: key for key, names in _ALIASES.items() for alias in names}


def gpu_preset(name: str) -> GpuSpec:
    key = re.sub(r"[^A-Z0-9]", "", name.upper())
    if key not in _LOOKUP:
        raise ValueError(
            f"unknown GPU {name!r}; known: {', '.join(GPU_PRESETS)}; for another GPU give its "
            "memory (--gpus 2x94GB, or --gpu-memory 94GB) and --gpu-bandwidth (e.g. 3.9TB/s)"
        )
    return GPU_PRESETS[_LOOKUP[key]]


def custom_gpu(memory: int, bandwidth: float | None) -> GpuSpec:
    """A GPU that is not in the table: its memory (bytes) and HBM bandwidth (bytes/s; None:
    unknown, `DEFAULT_CUSTOM_BANDWIDTH` is assumed and the plan says so)."""
    if memory <= 0:
        raise ValueError(f"GPU memory must be positive, got {memory}")
    bw = DEFAULT_CUSTOM_BANDWIDTH if bandwidth is None else bandwidth
    name = f"{memory / 2**30:g}GB"
    return GpuSpec(name, memory, bw, False, True, bandwidth_assumed=bandwidth is None)


DEFAULT_CUSTOM_BANDWIDTH = 2.0e12  # assumed for a GPU given by its memory only (said in output)


def parse_gpus(
    text: str, memory: str | None = None, bandwidth: str | None = None
) -> tuple[int, GpuSpec | None]:
    """'8xH100' -> (8, H100); 'H200' -> (1, H200); '2x94GB' -> (2, a 94 GiB GPU); '2' with
    `memory` ('94GB') -> the same; 'none' or '0' -> (0, None). `memory` / `bandwidth` (the
    --gpu-memory / --gpu-bandwidth strings) override a named GPU's figures."""
    s = text.strip()
    if s.lower() in ("none", "0", "cpu", ""):
        return 0, None
    m = re.fullmatch(r"(?:(\d+)\s*[x×*]\s*)?(.+)", s, flags=re.IGNORECASE)
    count = int(m.group(1)) if m and m.group(1) else 1
    name = m.group(2) if m else s
    if m and not m.group(1) and name.isdigit():  # '--gpus 2 --gpu-memory 94GB'
        count, name = int(name), ""
    if count <= 0:
        raise ValueError(f"--gpus {text!r}: the count must be positive (or use 'none')")
    bw = parse_bandwidth(bandwidth) if bandwidth else None
    if re.fullmatch(r"\s*[0-9.]+\s*[GT]i?B\s*", name, flags=re.IGNORECASE):
        if memory:
            raise ValueError(f"--gpus {text!r} already gives the memory; drop --gpu-memory")
        return count, custom_gpu(parse_size(name), bw)
    if not name:
        if not memory:
            raise ValueError(
                f"--gpus {text!r} names no GPU: write COUNTxGPU (e.g. 8xH200), COUNTxMEMORY "
                "(e.g. 2x94GB), or give --gpu-memory (and --gpu-bandwidth)"
            )
        return count, custom_gpu(parse_size(memory), bw)
    spec = gpu_preset(name)
    if memory or bw is not None:
        spec = replace(
            spec,
            memory_bytes=parse_size(memory) if memory else spec.memory_bytes,
            bandwidth=bw if bw is not None else spec.bandwidth,
        )
    return count, spec


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int | float) -> int:
    """'1TB' / '1T' / '1024GiB' / '512G' -> bytes (binary units); a bare number is bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read size {text!r}; write e.g. 1TB, 768GB, 0")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_bandwidth(text: str | int | float) -> float:
    """'300GB/s' / '300' (GB/s) / '1.2TB/s' -> bytes per second (decimal units)."""
    if isinstance(text, (int, float)):
        return float(text) * 1e9
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(B(/S)?)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read bandwidth {text!r}; write e.g. 300GB/s")
    unit = m.group(2).upper() or ("" if m.group(3) else "G")
    return float(m.group(1)) * {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]


def format_bytes(n: float) -> str:
    """Binary units, 1 decimal: 70272 -> '68.6 KiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
