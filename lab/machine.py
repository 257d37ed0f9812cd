"""The machine a figure came from: printed first by every bench and stored with its results.

A benchmark's ratio depends on the CPU (bitsandbytes and oneDNN choose kernels by CPU
features), the core count and the library versions, so each result carries them. Versions are
read from the installed packages' metadata: nothing is imported to learn them (bitsandbytes in
particular is imported only when 4-bit is asked for).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from lab.device import usable_cores
from lab.redact import redact_argv

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "peft",
    "bitsandbytes",
    "numpy",
    "hydra-core",
    "grpcio",  # netproto's bench measures gRPC
)
"""Whose versions a figure depends on."""

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "neon", "asimd")
"""CPU features that change which kernels torch and bitsandbytes run."""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        import subprocess

        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class Machine:
    """What ran a measurement: CPU, cores, memory, accelerator, library versions."""

    cpu: str
    cpu_flags: list[str]
    cores: int
    memory_gib: float
    system: str
    python: str
    device: str
    device_name: str
    packages: dict[str, str] = field(default_factory=dict)
    bnb_4bit: str | None = None
    """Only when 4-bit was asked for: which bitsandbytes imports here (None: not asked, so
    bitsandbytes was not imported)."""
    load_1m: float | None = None
    """The system's load average over the minute before the probe (None where the system has
    none): near or above `cores`, something else was running, and timings are not the
    machine's best (the report says so)."""

    @classmethod
    def probe(cls, *, quantization: bool = False) -> Machine:
        import psutil
        import torch

        from lab.device import detect_device

        device = detect_device()
        device_name = "cpu"
        if device.type == "cuda":
            device_name = torch.cuda.get_device_properties(device).name
        elif device.type == "mps":
            device_name = "Apple MPS"
        bnb_4bit = None
        if quantization:
            from lab.quantization import bnb_importable

            bnb_4bit = bnb_importable()[1]
        return cls(
            cpu=_cpu_model(),
            cpu_flags=_cpu_flags(),
            cores=usable_cores(),
            memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
            system=platform.platform(terse=True),
            python=platform.python_version(),
            device=str(device),
            device_name=device_name,
            packages={name: _version(name) for name in PACKAGES},
            bnb_4bit=bnb_4bit,
            load_1m=_load(),
        )

    def describe(self) -> str:
        """Two or three lines for the top of a bench's output."""
        flags = " ".join(self.cpu_flags) or "none of " + "/".join(CPU_FLAGS)
        device = self.device if self.device_name == "cpu" else f"{self.device} ({self.device_name})"
        lines = [
            f"machine: {self.cpu}, {self.cores} cores, {self.memory_gib:g} GiB, {self.system}, "
            f"device {device}; CPU features: {flags}",
            "versions: python "
            + self.python
            + ", "
            + ", ".join(f"{name} {version}" for name, version in self.packages.items()),
        ]
        if self.bnb_4bit is not None:
            lines.append(f"4-bit: {self.bnb_4bit}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def announce_machine(*, quantization: bool = False) -> Machine:
    """Probe the machine and print it first, as every bench's output begins."""
    machine = Machine.probe(quantization=quantization)
    print(machine.describe(), flush=True)
    return machine


def write_results(path: Path, results: dict[str, Any], *, machine: Machine) -> None:
    """A bench's JSON results, with the machine that produced them stored beside them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", *redact_argv(sys.argv)])
    header = {"command": command, "machine": machine.as_dict()}
    path.write_text(json.dumps({**header, **results}, indent=2, default=str))
