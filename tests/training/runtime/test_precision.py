from pathlib import Path

import pytest

from training.pretrain.config import TrainConfig
from training.runtime import precision
from training.runtime.precision import (
    NATIVE_BF16_FLAGS,
    NO_NATIVE_BF16_ENV,
    cpu_has_native_bf16,
    emulated_bf16_problem,
    parse_cpu_flags,
)

CPUINFO = Path("/proc/cpuinfo")


@pytest.fixture
def no_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test-only switch off, whatever the environment of the run says."""
    monkeypatch.delenv(NO_NATIVE_BF16_ENV, raising=False)


def test_parse_cpu_flags_reads_only_the_flags_lines() -> None:
    text = (
        "processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: spectre_v1\n\n"
        "processor\t: 1\nflags\t\t: fpu amx_bf16 amx_tile\nFeatures\t: bf16 sve\n"
    )
    assert parse_cpu_flags(text) == {"fpu", "avx2", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert parse_cpu_flags("Features\t: fp asimd bf16\n") == frozenset()  # ARM: no flags lines


def test_flag_detection_agrees_with_torchs_own_probes(no_switch: None) -> None:
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    missing = [name for name in probes if not hasattr(torch.cpu, name)]
    if missing:
        pytest.skip(f"torch {torch.__version__} has no torch.cpu.{', '.join(missing)}")
    if not CPUINFO.is_file():
        pytest.skip("no /proc/cpuinfo here: detection asks torch's probes itself")
    flags = parse_cpu_flags(CPUINFO.read_text())
    torch_says = any(getattr(torch.cpu, name)() for name in probes)
    assert cpu_has_native_bf16() == bool(flags & NATIVE_BF16_FLAGS) == torch_says


def test_the_env_switch_makes_detection_say_no_native_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precision, "_linux_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.delenv(NO_NATIVE_BF16_ENV, raising=False)
    assert cpu_has_native_bf16()
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "0")
    assert cpu_has_native_bf16()
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    assert not cpu_has_native_bf16()
    assert TrainConfig().precision == "fp32"
    assert TrainConfig(scale={"use_gpu": True}).precision == "bf16"  # a GPU's bf16 is native


def test_auto_records_its_choice_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    auto = TrainConfig()
    assert (auto.precision, auto.requested_precision) == ("fp32", "auto")
    expected = "precision auto -> fp32 (this CPU has no native bf16 matrix instructions)"
    assert auto.precision_choice() == expected
    gpu = TrainConfig(scale={"use_gpu": True})
    assert gpu.precision_choice() == "precision auto -> bf16 (the run uses GPUs (scale.use_gpu))"
    explicit = TrainConfig(precision="fp32")
    assert explicit.requested_precision == "fp32"
    assert explicit.precision_choice() == "precision fp32 (as configured)"
    assert TrainConfig.model_validate(auto.model_dump()).requested_precision == "fp32"


def test_emulated_bf16_problem_names_the_fixes_and_the_opt_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    problem = emulated_bf16_problem("train", "bf16", allow=False, use_gpu=False, cluster=False)
    assert problem is not None
    for words in ("emulated", "100x", "auto", "fp32", "train.allow_emulated_bf16=true"):
        assert words in problem
    for allowed in ({"allow": True}, {"use_gpu": True}, {"cluster": True}):
        args = {"allow": False, "use_gpu": False, "cluster": False} | allowed
        assert emulated_bf16_problem("train", "bf16", **args) is None
    assert emulated_bf16_problem("train", "fp32", False, False, False) is None
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert emulated_bf16_problem("train", "bf16", False, False, False) is None
