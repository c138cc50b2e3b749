import pytest

from training.finetune.config import FinetuneConfig
from training.runtime.precision import NO_NATIVE_BF16_ENV


def test_finetune_auto_precision_resolves_as_pretraining_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    auto = FinetuneConfig(precision="auto")
    assert (auto.precision, auto.requested_precision) == ("fp32", "auto")
    assert "auto -> fp32 (this CPU has no native bf16" in auto.precision_choice()
    assert FinetuneConfig(precision="auto", scale={"use_gpu": True}).precision == "bf16"
    default = FinetuneConfig()  # fp32 stays the default: fine-tuning results do not move
    assert (default.precision, default.requested_precision) == ("fp32", "fp32")
    assert FinetuneConfig(precision="bf16").precision == "bf16"  # refused only at the root
