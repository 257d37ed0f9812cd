"""Device detection: CUDA, then MPS, then CPU; dtype per device; 4-bit warning."""

from __future__ import annotations

import pytest
import torch

import lab.device as device_mod
from lab.device import (
    default_dtype,
    detect_device,
    resolve_dtype,
)
from tests.clocks import HANG_GUARD_S

NO_ACCELERATOR = not torch.cuda.is_available() and not device_mod._mps_available()


@pytest.mark.skipif(not NO_ACCELERATOR, reason="this machine has an accelerator")
def test_cpu_only_machine_detects_cpu_and_float32() -> None:
    device = detect_device()
    assert device.type == "cpu"
    assert default_dtype(device) == torch.float32


def test_cuda_is_preferred_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_mod, "_mps_available", lambda: True)
    assert detect_device() == torch.device("cuda", 0)


def test_on_cuda_attention_is_kept_off_cudnns_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's attention rebuilt a graph per sequence length on an H200 (7.9 ms of CPU a call
    while decoding): a process that picks CUDA runs flash / memory-efficient attention."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        assert detect_device() == torch.device("cuda", 0)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()  # the others stay as they were
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_mps_is_preferred_over_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_mod, "_mps_available", lambda: True)
    assert detect_device() == torch.device("mps")
    assert default_dtype(torch.device("mps")) == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_asking_for_missing_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        detect_device("cuda")


def test_named_dtypes_resolve_and_unknown_ones_fail() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", cpu)


def test_machine_header_names_cpu_cores_versions_and_does_not_import_bitsandbytes() -> None:
    """Every bench prints it first; asking for it must not load bitsandbytes' native code."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from lab.machine import Machine\n"
        "m = Machine.probe()\n"
        "print(m.describe())\n"
        "assert 'bitsandbytes' not in sys.modules, 'the header imported bitsandbytes'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    header = result.stdout
    assert header.startswith("machine: ")
    assert f"torch {torch.__version__}" in header
    assert "transformers " in header and "bitsandbytes " in header
    assert "cores" in header


def test_machine_header_reports_4bit_only_when_asked() -> None:
    from lab.machine import Machine

    assert Machine.probe().bnb_4bit is None
    assert "bitsandbytes" in (Machine.probe(quantization=True).bnb_4bit or "")
