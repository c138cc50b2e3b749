"""The `train` section: what to pretrain, on how many workers, and how (optimizer, precision, ZeRO).

The DeepSpeed dict is derived from this (`training/runtime/deepspeed.py`), never hand-written; extra
DeepSpeed keys can still be passed through `deepspeed_extra`. What `precision: auto` means on this
machine (`cpu_has_native_bf16`, `resolve_auto_precision`) and when bf16 is refused
(`emulated_bf16_problem`) live here too; fine-tuning uses the same rules. So does the
`train.distillation` section (`DistillConfig`, re-exported by `training/models/distill.py`), so
that a recipe validates without importing torch (`lmpipe config`).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic.functional_validators import ModelWrapValidatorHandler

from training.models.config import (
    Attention,
    DocumentAttention,
    ElectraConfig,
    ModelConfig,
    document_attention,
)
from training.pretrain.length_schedule import LengthSchedule
from training.registry.model_ref import BaseModelRef

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


class DistillConfig(BaseModel):
    """The teacher and the loss weights of distillation (`train.distillation`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    teacher: BaseModelRef = Field(
        description="The BERT teacher: a local HF directory (`path`) or a registry version."
    )
    temperature: float = Field(2.0, gt=0, description="Softmax temperature of the soft targets.")
    alpha_kd: float = Field(5.0, ge=0, description="Weight of the soft-target KL loss.")
    alpha_mlm: float = Field(2.0, ge=0, description="Weight of the student's masked-LM loss.")
    alpha_cos: float = Field(1.0, ge=0, description="Weight of the hidden-state cosine loss.")
    student_layers: int | None = Field(
        None, ge=1, description="Student depth; None: half the teacher's layers."
    )


class OptimConfig(BaseModel):
    """AdamW with warm-up then decay; no weight decay on biases and norms."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-6, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(
        0.01, ge=0, description="Decoupled weight decay (not on biases/norms)."
    )
    grad_clip: float = Field(
        1.0, ge=0, description="Max global gradient norm; 0 turns clipping off."
    )
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps from 0 to `lr`.")
    decay: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="Learning-rate decay after warm-up, down to `min_lr_ratio * lr`."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate / peak.")


class GuardConfig(BaseModel):
    """What a non-finite or spiking loss does."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A NaN/inf loss stops the run (stop) or leaves the weights as they "
        "were for that step (skip).",
    )
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="A loss above this factor times the running mean is a spike; "
        "None turns spike detection off.",
    )
    spike_window: int = Field(20, ge=2, description="Steps in the running mean of the loss.")
    on_spike: Literal["stop", "skip"] = Field("skip", description="What a spike does.")
    max_skips: int = Field(10, ge=0, description="Skipped steps in a row before the run stops.")


class ScaleConfig(BaseModel):
    """How many workers, what each gets, and where they run (Ray Train or this process)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    num_workers: int = Field(2, ge=1, description="Ray Train workers (data-parallel ranks).")
    launcher: Literal["auto", "ray", "in_process"] = Field(
        "auto",
        description="Where the workers run. ray: Ray Train workers, restarted from the last "
        "checkpoint on failure (max_failures), on a cluster when ray.address is set. "
        "in_process: one worker in this process, without starting Ray Train (no restarts). "
        "auto: in_process for one worker with max_failures 0 and no Ray cluster address, "
        "else ray.",
    )
    use_gpu: bool = Field(False, description="One GPU per worker.")
    cpus_per_worker: float = Field(1, gt=0, description="Logical CPUs Ray reserves per worker.")
    threads_per_worker: int = Field(1, ge=1, description="torch intra-op threads per worker.")
    max_failures: int = Field(
        2, ge=-1, description="Worker-group restarts from the latest checkpoint (-1: no limit)."
    )
    backend: Literal["gloo", "nccl"] | None = Field(
        None,
        description="torch.distributed backend; default nccl on GPU, gloo on CPU. nccl runs "
        "with gloo beside it for CPU tensors (cpu:gloo,cuda:nccl).",
    )
    report_poll_s: float = Field(
        0.2,
        gt=0,
        le=60,
        description="How often Ray Train's controller polls the workers "
        "(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S). It takes one report per poll and a worker's next "
        "report waits for it, so every checkpoint or epoch report can wait this long; Ray's "
        "own default of 2 s dominated short runs.",
    )

    @model_validator(mode="after")
    def _in_process_is_one_worker(self) -> Self:
        if self.launcher != "in_process":
            return self
        if self.num_workers != 1:
            raise ValueError(
                f"launcher in_process runs one worker in this process, not num_workers "
                f"{self.num_workers}: set num_workers to 1, or launcher to ray"
            )
        if self.max_failures != 0:
            raise ValueError(
                f"launcher in_process cannot restart a failed worker (max_failures "
                f"{self.max_failures}): set max_failures to 0, or launcher to ray"
            )
        return self


class CheckpointConfig(BaseModel):
    """Where and how often checkpoints are written."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    every_steps: int = Field(50, ge=1, description="Save every N optimizer steps (and at the end).")
    keep_last: int = Field(
        2, ge=1, description="Complete checkpoints kept; older ones are removed."
    )
    storage_path: Path | None = Field(
        None, description="Directory (local or shared) for runs; default <workspace>/pretrain."
    )


class EvalConfig(BaseModel):
    """Held-out evaluation on the examples' validation split."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    every_steps: int = Field(50, ge=1, description="Evaluate every N steps (and at the end).")
    max_samples: int = Field(512, ge=1, description="Validation examples per evaluation.")


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


class TrainConfig(AutoPrecision):
    """Pretraining: model, batch, optimizer, precision, ZeRO stage, checkpoints, evaluation."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: ModelConfig = Field(default_factory=ModelConfig)
    max_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    global_batch_size: int = Field(32, ge=1, description="Samples per optimizer step, all ranks.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per forward pass on one rank; None (default): the rank's whole "
        "share of the global batch, so no gradient accumulation. Set it when that share does "
        "not fit in memory.",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Compute precision. auto (default) is bf16 on a GPU (scale.use_gpu) and on "
        "a CPU with native bf16 matrix instructions (AVX512-BF16 or AMX), fp32 elsewhere; the "
        "resolved value is what the config records. fp16 needs a GPU (loss scaling). bf16 "
        "on a CPU without native bf16 (no GPU, no ray.address) is refused when the config "
        "loads, unless allow_emulated_bf16.",
    )
    allow_emulated_bf16: bool = Field(
        False,
        description="Allow precision bf16 on this machine's CPU although it has no native bf16 "
        "matrix instructions (emulated: about 100x slower than fp32 per matmul); for "
        "benchmarks and tests that compare precisions on purpose.",
    )
    zero_stage: int = Field(
        0,
        ge=0,
        le=3,
        description="DeepSpeed ZeRO stage. 0 (default, as in DeepSpeed itself) keeps a whole "
        "optimizer state on every worker; 1, 2 and 3 partition the optimizer state, then the "
        "gradients, then the weights across workers to fit larger models, at some cost per "
        "step (ZeRO 2 on one worker: about 10% of a CPU step).",
    )
    compile: bool = Field(False, description="torch.compile the model.")
    compile_scope: Literal["model_and_loss", "modules"] = Field(
        "model_and_loss",
        description="What `compile` compiles: model_and_loss (the forward pass and the loss as "
        "one graph, so the logits' masking, cast and cross-entropy fuse) or modules (each "
        "top-level module of the model apart). ZeRO 3 always compiles modules.",
    )
    sparse_mlm: bool = Field(
        True, description="Compute masked-LM logits only at masked positions (as BERT does)."
    )
    document_masking: bool = Field(
        False, description="causal: restart positions and block attention at document starts."
    )
    attention: Attention = Field(
        "auto",
        description="How document-masked causal blocks attend. dense: a (B, 1, L, L) mask "
        "through SDPA (no flash kernel). flex: FlexAttention block masks built from the "
        "document ids (needs a GPU, document_masking, a causal family and no attention "
        "dropout). auto (default): flex wherever it can train, else dense. Blocks of one "
        "document, and unpadded encoder batches, get no mask at all either way.",
    )
    length_schedule: LengthSchedule | None = Field(
        None,
        description="Sequence length by step (training/pretrain/length_schedule.py): `staged` "
        "stages or "
        "`alternate` short and full-length steps; None trains at the examples' length.",
    )
    electra: ElectraConfig = Field(
        default_factory=ElectraConfig,
        description="model.family electra: the generator and the discriminator loss weight.",
    )
    distillation: DistillConfig | None = Field(
        None,
        description="model.family distilbert: distil from this BERT teacher "
        "(training/models/distill.py); "
        "None trains DistilBERT with MLM alone.",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log_every_steps: int = Field(
        20,
        ge=1,
        description="Read the training metrics from the device every N steps (also before "
        "evaluation, checkpoints and the end): steps.jsonl gets every step, MLflow every N-th "
        "and the last of each read.",
    )
    log_sample_ids: bool = Field(
        False, description="Write the global sample ids each rank consumes, per step (audits)."
    )
    verify_shards: bool = Field(True, description="Check each example shard's sha256 at start.")
    prefetch: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Build the next step's batches (gather, mask, pin) in a background thread "
        "while the device runs this step. auto: on a GPU (the step then never waits on "
        "NumPy); off on a CPU, whose cores run the step itself. It changes when the batches "
        "are built, not what they hold.",
    )
    deepspeed_extra: dict[str, Any] = Field(
        default_factory=dict, description="Extra DeepSpeed config keys, merged over the generated."
    )
    model_name: str | None = Field(
        None, description="Registered model name; default <run name>-<family>."
    )
    alias: str = Field("candidate", description="Registry alias set on the new model version.")

    @model_validator(mode="after")
    def _distillation_needs_distilbert(self) -> TrainConfig:
        if self.distillation is not None and self.model.family != "distilbert":
            raise ValueError(
                "train.distillation trains a DistilBERT student: set train.model.family to "
                f"distilbert (it is {self.model.family})"
            )
        return self

    @model_validator(mode="after")
    def _fp16_needs_gpu(self) -> TrainConfig:
        if self.precision == "fp16" and not self.scale.use_gpu:
            raise ValueError("precision fp16 needs a GPU (scale.use_gpu); use bf16 or fp32 on CPU")
        return self

    @model_validator(mode="after")
    def _attention_can_train(self) -> TrainConfig:
        self.document_attention()  # raises, naming train.attention, where flex cannot train
        return self

    def document_attention(self) -> DocumentAttention:
        """How this run's document-masked blocks attend: `attention` with `auto` resolved."""
        return document_attention(
            self.attention, self.model, self.document_masking, self.scale.use_gpu
        )

    def micro_batch(self, world_size: int) -> int:
        """Samples per forward pass on one of `world_size` ranks (`micro_batch_size` resolved)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        if self.global_batch_size % world_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of the "
                f"workers ({world_size}), or set train.micro_batch_size"
            )
        return self.global_batch_size // world_size

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step; the global batch must split evenly."""
        micro = self.micro_batch(world_size)
        if self.global_batch_size % (micro * world_size):
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of "
                f"train.micro_batch_size ({micro}) x workers ({world_size})"
            )
        return self.global_batch_size // (micro * world_size)
