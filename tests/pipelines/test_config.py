from pathlib import Path

import pytest
import yaml

from pipelines.config import ConfigError, load_config
from tasks.common.io import public_dump

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
