from pathlib import Path

import pytest
import yaml

from pipelines.config import ConfigError, load_config
from tasks.common.io import public_dump
from training.runtime.precision import NO_NATIVE_BF16_ENV

BASE = {"name": "t", "ingest": {"sources": [{"path": "corpus.txt"}]}}


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return path


def test_load_config_applies_dotted_overrides(recipe: Path) -> None:
    cfg = load_config(
        recipe,
        [
            "ingest.shard_size_mb=16",
            "ray.num_workers=4",
            "ingest.sources.0.txt_mode=line",
            "ingest.split.test=0.1",
        ],
    )
    assert cfg.ingest.shard_size_mb == 16
    assert cfg.ray.num_workers == 4
    assert cfg.ingest.sources[0].txt_mode == "line"
    assert cfg.ingest.split.test == 0.1


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("ingest.shard_size_mb=-1", "ingest.shard_size_mb", "greater than or equal"),
        ("ingest.shard_sise_mb=16", "ingest.shard_sise_mb", "unknown key"),
        ("ray.num_workers=many", "ray.num_workers", "valid integer"),
        ("ray.num_workers=0", "ray.num_workers", "greater than or equal to 1"),
        ("ingest.sources.0.txt_mode=paragraph", "ingest.sources.0.txt_mode", "must be one of"),
        ("ingest.sources.0.format=docx", "ingest.sources.0.format", "must be one of"),
        ("ingest.split.validation=0.995", "ingest.split", "must be < 1"),
        ("ingest.clean.normalization=NFX", "ingest.clean.normalization", "must be one of"),
        ("ingest.sentences.splitter=rm -rf", "ingest.sentences.splitter", "package.module"),
        ("ingest.dedup.near.threshold=1.5", "ingest.dedup.near.threshold", "less than 1"),
        ("ingest.sources.0.weight=0", "ingest.sources.0.weight", "greater than 0"),
        ("ingest.sources.0.name=../x", "ingest.sources.0.name", "letters, digits"),
        ("name=../../etc", "name", "letters, digits"),
        ("ingest.min_chars=10", "ingest", None),  # valid alone: control case below
        ("tracking.experiment=", "tracking.experiment", "at least 1 character"),
        ("workspace=[1, 2]", "workspace", "path"),
    ],
)
def test_invalid_key_or_value_is_refused_naming_it(
    recipe: Path, override: str, key: str, hint: str | None
) -> None:
    if hint is None:
        load_config(recipe, [override])
        return
    with pytest.raises(ConfigError) as info:
        load_config(recipe, [override])
    message = str(info.value)
    assert f"  {key}" in message
    assert hint.lower() in message.lower()
    assert str(recipe) in message


@pytest.mark.parametrize("override", ["noequals", "a..b=1", "ingest.sources.7.path=x"])
def test_malformed_override_is_refused(recipe: Path, override: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        load_config(recipe, [override])


def test_missing_file_and_bad_yaml_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ingest: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML"):
        load_config(bad)


def test_secrets_never_reach_dumps_or_errors(recipe: Path) -> None:
    cfg = load_config(
        recipe,
        [
            "tracking.password=hunter2",
            "prefect.api_key=pk-123",
            "ingest.sources.0.storage_options={key: AKIA, secret: s3cr3t}",
        ],
    )
    dump = repr(public_dump(cfg))
    for secret in ("hunter2", "pk-123", "AKIA", "s3cr3t"):
        assert secret not in dump
        assert secret not in repr(cfg)
    assert cfg.tracking.password is not None
    assert cfg.tracking.password.get_secret_value() == "hunter2"
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["tracking.password=hunter2", "tracking.nope=1"])
    assert "hunter2" not in str(info.value)


def test_demo_recipe_is_valid() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    assert cfg.ingest.sources[0].format == "jsonl"


def test_roberta_recipe_is_valid_with_its_length_schedule() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "roberta_recipe.yaml")
    assert cfg.train.model.family == "roberta"
    assert cfg.examples.objective == "roberta"
    assert cfg.train.length_schedule is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.length_schedule={mode: alternate, short: 4096, every: 2}"],
            "exceeds the examples",
        ),
        (
            [
                "examples.objective=causal",
                "examples.block_size=64",
                "train.length_schedule={mode: alternate, short: 24, every: 2}",
            ],
            "does not divide",
        ),
        (
            [
                "examples.objective=span_corruption",
                "train.length_schedule={mode: alternate, short: 8, every: 2}",
            ],
            "not 'span_corruption'",
        ),
    ],
)
def test_length_schedule_is_checked_against_the_examples_before_any_stage(
    recipe: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(recipe, overrides)


@pytest.mark.parametrize("section", ["train", "finetune"])
def test_emulated_bf16_on_this_cpu_is_refused_naming_auto_fp32_and_the_opt_in(
    recipe: Path, section: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")  # as on a CPU without native bf16
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # no cluster: this machine trains
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [f"{section}.precision=bf16"])
    message = str(err.value)
    assert f"{section}.precision bf16 would train on this machine's CPU" in message
    assert "emulated" in message
    assert "100x slower than fp32" in message
    assert f"Set {section}.precision to auto" in message
    assert "or to fp32" in message
    assert f"{section}.allow_emulated_bf16=true" in message
    assert "'name'" not in message  # a check across sections does not echo the whole config


@pytest.mark.parametrize(
    "where",
    [
        "allow_emulated_bf16=true",  # the opt-in
        "scale.use_gpu=true",  # trains on GPUs
        None,  # ray.address set: trains on a cluster's CPUs
    ],
)
@pytest.mark.parametrize("section", ["train", "finetune"])
def test_bf16_is_accepted_with_the_opt_in_on_gpus_or_on_a_cluster(
    recipe: Path, section: str, where: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    extra = f"{section}.{where}" if where else "ray.address=ray://head:10001"
    cfg = load_config(recipe, [f"{section}.precision=bf16", extra])
    assert getattr(cfg, section).precision == "bf16"


def test_auto_is_never_refused_and_picks_fp32_on_a_cpu_without_native_bf16(
    recipe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    cfg = load_config(recipe, ["train.precision=auto", "finetune.precision=auto"])
    assert (cfg.train.precision, cfg.finetune.precision) == ("fp32", "fp32")
    assert cfg.train.requested_precision == "auto"


def test_bf16_is_accepted_where_a_cluster_trains_it(
    recipe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NO_NATIVE_BF16_ENV, "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError):
        load_config(recipe, ["train.precision=bf16"])
    # `lmpipe submit` checks the recipe here; the cluster trains it.
    assert load_config(recipe, ["train.precision=bf16"], remote=True).train.precision == "bf16"
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # fills ray.address after loading
    assert load_config(recipe, ["train.precision=bf16"]).train.precision == "bf16"
