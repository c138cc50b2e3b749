"""What `precision: auto` means on this machine, and when bf16 is refused.

`cpu_has_native_bf16` answers from the CPU flags (torch is imported only where /proc/cpuinfo
cannot answer), `resolve_auto_precision` picks bf16 or fp32, `emulated_bf16_problem` refuses
emulated bf16, and `AutoPrecision` is the base of the `train` and `finetune` sections, which
resolve `auto` before validation. Nothing here imports torch at import time, so a recipe
validates at once (`lmpipe config`).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import BaseModel, PrivateAttr, model_validator
from pydantic.functional_validators import ModelWrapValidatorHandler

from training.runtime.config import ScaleConfig

# Linux /proc/cpuinfo flags of native bf16 matrix instructions: AVX512-BF16 and AMX-BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# The test-only switch of `assume_no_native_bf16` (docs/testing.md).
NO_NATIVE_BF16_ENV = "LMPIPE_ASSUME_NO_NATIVE_BF16"
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU flags named on the `flags` lines of a Linux /proc/cpuinfo text (x86 only)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


@cache
def _linux_cpu_flags() -> frozenset[str] | None:
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError:  # not Linux, or no procfs
        return None


def assume_no_native_bf16() -> bool:
    """Test-only switch: whether `LMPIPE_ASSUME_NO_NATIVE_BF16` is set (to anything but 0).

    It makes `cpu_has_native_bf16` answer False, so the suite runs as it would on a CPU without
    native bf16 (docs/testing.md). This is the one environment read outside the `pipelines/`
    entry points: the answer is needed wherever a config is validated, and a switch meant only
    for tests should not become a config key.
    """
    return os.environ.get(NO_NATIVE_BF16_ENV, "") not in ("", "0")


def torch_has_native_bf16() -> bool:
    """Ask torch's private probes for AVX512-BF16 and AMX tiles (x86 only).

    Imports torch, so it is asked only where /proc/cpuinfo cannot answer.
    """
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu, private
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX-BF16).

    There bf16 autocast trains about 1.7x as fast as fp32 (docs/benchmarks.md); without them
    bf16 is emulated and far slower than fp32. On Linux the answer comes from the CPU flags in
    /proc/cpuinfo, without importing torch (an ARM CPU has no `flags` lines: False). Elsewhere
    an x86 CPU asks torch's probes, imported only then, and any other CPU is taken to have none:
    torch's CPU bf16 kernels are native only through those x86 extensions. The test-only
    `LMPIPE_ASSUME_NO_NATIVE_BF16=1` makes the answer False (`assume_no_native_bf16`).
    """
    if assume_no_native_bf16():
        return False
    flags = _linux_cpu_flags()
    if flags is not None:
        return bool(flags & NATIVE_BF16_FLAGS)
    if platform.machine().lower() not in X86_MACHINES:
        return False
    return torch_has_native_bf16()


def resolve_auto_precision(use_gpu: bool) -> tuple[Literal["bf16", "fp32"], str]:
    """What `precision: auto` means for a run on GPUs (`use_gpu`) or this CPU, and why."""
    if use_gpu:
        return "bf16", "the run uses GPUs (scale.use_gpu)"
    if cpu_has_native_bf16():
        return "bf16", "this CPU has native bf16 matrix instructions"
    return "fp32", "this CPU has no native bf16 matrix instructions"


def precision_choice(precision: str, auto_reason: str | None) -> str:
    """One line for the start of a run: its precision and, when `auto` chose it, why."""
    if auto_reason is None:
        return f"precision {precision} (as configured)"
    return f"precision auto -> {precision} ({auto_reason})"


def emulated_bf16_problem(
    section: str, precision: str, allow: bool, use_gpu: bool, cluster: bool
) -> str | None:
    """Why `<section>.precision` bf16 may not train on this machine's CPU; None if it may.

    bf16 trains on this CPU when the section uses no GPU and no Ray cluster address is set
    (`cluster`); without native bf16 matrix instructions it is emulated there, about 100x
    slower than fp32. `allow` (`<section>.allow_emulated_bf16`) lets it run anyway.
    """
    if precision != "bf16" or allow or use_gpu or cluster or cpu_has_native_bf16():
        return None
    return (
        f"{section}.precision bf16 would train on this machine's CPU ({section}.scale.use_gpu "
        "is false and ray.address is not set), and this CPU has no native bf16 matrix "
        "instructions (AVX512-BF16 or AMX), so bf16 is emulated: measured about 100x slower "
        "than fp32 (a 1024x1024 matmul ran at 0.9 GFLOP/s in bf16 against 106 GFLOP/s in fp32 "
        f"on an AVX2-only AMD EPYC). Set {section}.precision to auto (fp32 on this CPU, bf16 "
        f"where it is native) or to fp32; or, to run emulated bf16 on purpose (to compare "
        f"precisions), set {section}.allow_emulated_bf16=true"
    )


def auto_precision_data(data: Any, default: str = "auto") -> tuple[Any, str | None]:
    """A section's raw input with `precision: auto` resolved, and why (None: not auto).

    `default` is the section's default precision. Used by the `train` and `finetune` sections
    before validation, so that the saved config, the run identity and every worker see the same
    concrete precision.
    """
    if not isinstance(data, dict) or data.get("precision", default) != "auto":
        return data, None
    scale = data.get("scale")
    use_gpu = (
        scale.use_gpu if isinstance(scale, ScaleConfig) else bool((scale or {}).get("use_gpu"))
    )
    precision, reason = resolve_auto_precision(use_gpu)
    return {**data, "precision": precision}, reason


class AutoPrecision(BaseModel):
    """A section whose `precision` may be `auto`: resolved before validation, and why.

    `TrainConfig` and `finetune`'s `FinetuneConfig` derive from it; `PRECISION_DEFAULT` is the
    section's default precision. The resolved value is what the saved config, the run identity
    and every worker see.
    """

    PRECISION_DEFAULT: ClassVar[str] = "auto"
    if TYPE_CHECKING:  # each section declares its own `precision` field
        precision: str
    # Why `auto` chose `precision`, set when this object was validated from `auto`; None when
    # the precision was given (a saved, already resolved config included).
    _auto_reason: str | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_auto_precision(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        data, reason = auto_precision_data(data, default=cls.PRECISION_DEFAULT)
        cfg = handler(data)
        if reason is not None:  # a new object: `data` was a mapping
            cfg._auto_reason = reason
        return cfg

    @property
    def requested_precision(self) -> str:
        """The precision asked for: `auto`, or the value of `precision` when it was given."""
        return "auto" if self._auto_reason else str(self.precision)

    def precision_choice(self) -> str:
        """The run's precision in one line, e.g. `precision auto -> fp32 (this CPU has ...)`."""
        return precision_choice(str(self.precision), self._auto_reason)

    def __eq__(self, other: object) -> bool:
        """Equal fields: how `precision` was chosen (given, or by `auto`) is not compared.

        A config saved with `auto` resolved and loaded again trains exactly the same run.
        """
        if not isinstance(other, AutoPrecision):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = BaseModel.__hash__
