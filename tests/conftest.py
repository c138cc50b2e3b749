"""Session-wide fixtures: one local Ray, one Prefect API and one MLflow store per test session.

Environment first: Ray reads RAY_AUTH_MODE at import (docs/stack.md, "Ray token authentication")
and Prefect reads its settings at import, so they are set before anything imports either.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="lmpipe-tests-"))
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect")
os.environ["LMPIPE_CACHE_DIR"] = str(_SESSION_TMP / "cache")  # the store templates
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "90"
os.environ["HF_HUB_OFFLINE"] = "1"
# Each `lmpipe` a test runs is its own process; tests/pipelines/daemon starts its daemons.
os.environ["LMPIPE_DAEMON"] = "0"
os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("RAY_ADDRESS", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)

import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The public data in ../shared/data; tests that need it skip where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (CI always has it)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_session() -> Iterator[str]:
    """Start one local Ray for the whole session; yield its GCS address; stop exactly it."""
    import ray

    from tasks.common.ray_runtime import RayConfig, ensure_ray

    ensure_ray(RayConfig(num_workers=2, num_cpus=4))
    address = ray.get_runtime_context().gcs_address
    yield address
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """One Prefect API (the test harness's temporary server) for the session; yield its URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def mlflow_uri() -> str:
    """One MLflow store (SQLite) for the session."""
    return f"sqlite:///{_SESSION_TMP / 'mlflow.db'}"


@pytest.fixture
def tiny_text_table() -> pa.Table:
    """About twenty raw documents with the clean-up cases the core must handle."""
    texts = [f"Document number {i}. It has two sentences." for i in range(16)]
    texts += ["\ufeffBOM  and\r\nCRLF\r\n", "   ", "x", "Tabs\tand\x07bells."]
    return pa.table(
        {
            "offset": pa.array(range(len(texts)), pa.int64()),
            "line": pa.array(range(1, len(texts) + 1), pa.int64()),
            "text": pa.array(texts, pa.large_string()),
        }
    )


# Tiny base models to fine-tune: one per family the downstream tests use.
_TINY_TOKENIZERS: dict[str, dict[str, Any]] = {
    "bert": {"family": "wordpiece", "vocab_size": 300, "min_frequency": 1},
    "gpt2": {"family": "bpe", "vocab_size": 400, "min_frequency": 1},
    "t5": {"family": "unigram", "vocab_size": 300, "extra_ids": 4, "min_frequency": 1},
    "bart": {"family": "bpe", "bpe_style": "roberta", "vocab_size": 400, "min_frequency": 1},
    "electra": {"family": "wordpiece", "vocab_size": 300, "min_frequency": 1},
}
_TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "bert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
    "gpt2": {"n_embd": 32, "n_head": 2, "n_inner": 64, "n_positions": 128},
    "t5": {"d_model": 32, "num_heads": 2, "d_ff": 64, "d_kv": 16},
    "bart": {
        "d_model": 32,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "max_position_embeddings": 128,
    },
    "electra": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
}
_TINY_OBJECTIVE = {
    "bert": "bert",
    "gpt2": "causal",
    "t5": "span_corruption",
    "bart": "denoising",
    "electra": "roberta",
}


def _tiny_sentences() -> list[str]:
    rng = random.Random(0)
    words = [
        "the",
        "a",
        "movie",
        "film",
        "good",
        "bad",
        "was",
        "is",
        "not",
        "very",
        "plot",
        "actor",
        "story",
        "great",
        "poor",
        "and",
    ]
    return [" ".join(rng.choices(words, k=rng.randint(4, 12))) + "." for _ in range(300)]


@pytest.fixture(scope="session")
def tiny_base_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny seeded pretraining model and its tokenizer per family, saved as HF dirs."""
    import torch

    from tasks.tokenizer.tokenizer import (
        TokenizerConfig,
        padded_vocab_size,
        to_transformers,
        train_tokenizer,
    )
    from training.models.models import ModelConfig, build_model

    dirs = {}
    for family, tok_args in _TINY_TOKENIZERS.items():
        tok_cfg = TokenizerConfig.model_validate(tok_args)
        backend = train_tokenizer(_tiny_sentences(), tok_cfg)
        tok = to_transformers(backend, tok_cfg)
        ids = {"pad": tok.pad_token_id, "eos": tok.eos_token_id, "cls": tok.cls_token_id,
               "sep": tok.sep_token_id, "mask": tok.mask_token_id}  # fmt: skip
        torch.manual_seed(0)
        model = build_model(
            ModelConfig.model_validate({"family": family, "overrides": _TINY_OVERRIDES[family]}),
            _TINY_OBJECTIVE[family],
            padded_vocab_size(backend, tok_cfg),
            {**ids, "vocab_size": len(tok)},
            128,
        )
        dirs[family] = tmp_path_factory.mktemp(f"base-{family}")
        model.save_pretrained(dirs[family])
        tok.save_pretrained(dirs[family])
    return dirs


# The demo corpus cut into each objective's examples, once per session (pretraining and
# reliability tests).
_DEMO_TOKENIZER: dict[str, dict[str, Any]] = {
    "bert": {"family": "wordpiece"},
    "sop": {"family": "wordpiece"},
    "causal": {"family": "bpe"},
    "span_corruption": {"family": "unigram"},
    "roberta": {"family": "bpe"},
    "denoising": {"family": "bpe", "bpe_style": "roberta"},
}
_DEMO_BUILT: dict[tuple[str, str], dict[str, Path]] = {}


class DemoData:
    """Builds (once per session) the demo corpus's examples for an objective."""

    def __init__(self, root: Path) -> None:
        from tasks.common.ray_runtime import RayConfig
        from tasks.demo.synthetic import SyntheticConfig, write_corpus
        from tasks.ingest.ingest import IngestConfig
        from tasks.ingest.stage import run_ingest

        self.root = root
        self.ray = RayConfig(num_workers=2, num_cpus=4)
        corpus = root / "corpus"
        write_corpus(corpus, SyntheticConfig(seed=0, documents=1500))
        self.ingest = run_ingest(
            IngestConfig.model_validate(
                {
                    "sources": [{"path": str(corpus / "corpus"), "format": "jsonl"}],
                    "split": {"validation": 0.05, "test": 0.05},
                }
            ),
            self.ray,
            root / "ws",
        ).path

    def examples(
        self, objective: str, tokenizer: dict[str, Any] | None = None, **overrides: Any
    ) -> dict[str, Path]:
        """The objective's examples (and its tokenizer: `tokenizer` or the objective's usual)."""
        tok_args = tokenizer or _DEMO_TOKENIZER[objective]
        key = (objective, repr(sorted(tok_args.items())), repr(sorted(overrides.items())))
        if key not in _DEMO_BUILT:
            from tasks.encode.encode import EncodeConfig
            from tasks.encode.stage import run_encode
            from tasks.examples.config import ExamplesConfig
            from tasks.examples.stage import run_examples
            from tasks.tokenizer.stage import run_tokenizer
            from tasks.tokenizer.tokenizer import TokenizerConfig

            tok_cfg = TokenizerConfig.model_validate(
                {"vocab_size": 1024, "model_max_length": 512, **tok_args}
            )
            ws = self.root / "ws"
            tokenizer = run_tokenizer(tok_cfg, self.ingest, ws).path
            encode = run_encode(EncodeConfig(), self.ray, self.ingest, tokenizer, ws).path
            cfg = ExamplesConfig.model_validate(
                {"objective": objective, "max_seq_length": 64, "block_size": 64, **overrides}
            )
            out = run_examples(cfg, 0, self.ray, encode, tokenizer, ws).path
            _DEMO_BUILT[key] = {"examples": out, "tokenizer": tokenizer, "encode": encode}
        return _DEMO_BUILT[key]

    def pretrain(
        self,
        cfg: Any,
        data: dict[str, Path],
        workspace: Path,
        mlflow_uri: str,
        run_name: str,
        experiment: str = "pretrain-acceptance",
    ) -> dict[str, Any]:
        """`pretrain_stage` (seed 0, 2 workers on the session's Ray) on examples of `examples`."""
        from training.pretrain.stage import pretrain_stage
        from training.runtime.run_context import RunContext
        from training.tracking.runs import TrackingConfig

        tracking = TrackingConfig(tracking_uri=mlflow_uri, experiment=experiment)
        run = RunContext(workspace, seed=0, ray=self.ray, tracking=tracking, name=run_name)
        return pretrain_stage(cfg, data["examples"], data["tokenizer"], run=run)


@pytest.fixture(scope="session")
def demo_data(ray_session: str, tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """The synthetic demo corpus, ingested; `.examples(objective)` cuts examples on demand."""
    return DemoData(tmp_path_factory.mktemp("pretrain-data"))


@pytest.fixture(scope="module")
def single_process_dist() -> Iterator[None]:
    """World size 1 over gloo for DeepSpeed (in-process engines); its shm comm op is not built.

    Building that op JIT-compiles C++ (a minute on a fresh machine) and training never uses
    it (`training.runtime.engine.skip_cpu_shm_op`). DeepSpeed caches a clone of the world
    group, stale once a group is destroyed, so the cache is cleared around the group this
    fixture owns.
    """
    import deepspeed
    import torch
    from deepspeed.utils import groups

    from training.runtime.engine import skip_cpu_shm_op

    with pytest.MonkeyPatch.context() as mp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sock.getsockname()[1])}
        for key, value in {**env, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            mp.setenv(key, value)
        skip_cpu_shm_op()  # as the loops do before DeepSpeed's first initialize
        owned = not torch.distributed.is_initialized()
        sock.close()
        if owned:
            groups._WORLD_GROUP = None
        deepspeed.init_distributed(dist_backend="gloo")
        yield
        if owned:
            torch.distributed.destroy_process_group()
            groups._WORLD_GROUP = None


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module (tiny models; timings on shared cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
