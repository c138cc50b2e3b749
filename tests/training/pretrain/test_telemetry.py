"""MFU's denominator (`training.pretrain.telemetry.peak_flops`): datasheet peaks of known GPUs, a
measured peak elsewhere."""

from __future__ import annotations

import pytest
import torch

from training.pretrain import telemetry
from training.pretrain.telemetry import _PEAK_CACHE, datasheet_peak, measure_peak_flops, peak_flops
from training.runtime.precision import NO_NATIVE_BF16_ENV


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA H100 NVL", None),  # other clocks: measured, not guessed
        ("NVIDIA H200 NVL", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_peaks_are_the_dense_16_bit_figures(name: str, peak: float | None) -> None:
    assert datasheet_peak(name, torch.bfloat16) == peak
    assert datasheet_peak(name, torch.float16) == peak


def test_fp32_has_no_datasheet_peak() -> None:
    # torch's TF32 switch decides what an fp32 matmul runs as, so it is measured.
    assert datasheet_peak("NVIDIA H200", torch.float32) is None


def test_a_cpu_peak_is_measured_in_the_training_dtype() -> None:
    peak, source = peak_flops(torch.float32, use_gpu=False)
    assert source == "measured"
    assert peak == measure_peak_flops(torch.float32)  # cached: measured once per process
    assert 1e9 < peak < 1e13  # a CPU: GFLOP/s to a few TFLOP/s


def test_an_emulated_bf16_peak_is_fp32s_without_measuring_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An x86 CPU without AVX512-BF16 or AMX-BF16: its 1024^3 bf16 product takes seconds (12-25 s
    # for the measurement), and the maximum with fp32 is fp32's anyway.
    monkeypatch.delenv(NO_NATIVE_BF16_ENV, raising=False)
    monkeypatch.setattr(telemetry.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(telemetry, "cpu_has_native_bf16", lambda: False)
    monkeypatch.delitem(_PEAK_CACHE, torch.bfloat16, raising=False)
    assert peak_flops(torch.bfloat16, use_gpu=False) == (
        measure_peak_flops(torch.float32),
        "measured",
    )
    assert torch.bfloat16 not in _PEAK_CACHE  # not measured
