from pathlib import Path

import pytest

from tasks.common import ray_runtime
from tasks.common.ray_runtime import (
    RayConfig,
    cgroup_cpu_quota,
    check_storage,
    is_remote_uri,
    keep_sigterm_handler,
    local_ray_cpus,
    run_units,
    scoped_environ,
    storage_problem,
    usable_cores,
)


@pytest.mark.parametrize(
    ("workspace", "nodes", "shared", "refused"),
    [
        ("/data/ws", 1, False, False),  # one node sees its own disk
        ("/data/ws", 2, False, True),
        ("/data/ws", 2, True, False),  # NFS, or every node on one host
        ("relative/ws", 3, False, True),
        ("file:///data/ws", 2, False, True),  # a file URI is still a local path
        ("s3://bucket/ws", 2, False, False),
        ("gs://bucket/ws", 8, False, False),
        ("abfs://container@account/ws", 2, False, False),
        ("C://data/ws", 2, False, True),  # a drive letter is not a URI scheme
        ("/data/ws", 0, False, False),  # no alive node reported: nothing to compare
    ],
)
def test_storage_rule_over_workspace_nodes_and_shared_flag(
    workspace: str, nodes: int, shared: bool, refused: bool
) -> None:
    assert (storage_problem(workspace, nodes, shared) is not None) == refused


def test_storage_refusal_names_the_path_the_node_count_and_the_fix() -> None:
    message = storage_problem(Path("/data/ws"), 3, False)
    assert message is not None
    assert "workspace /data/ws is a local path" in message
    assert "the Ray cluster has 3 nodes" in message
    assert "ray.shared_storage=true" in message
    assert "s3://" in message


def test_is_remote_uri_only_for_non_file_schemes() -> None:
    assert is_remote_uri("s3://b/k")
    assert is_remote_uri("hdfs://namenode/ws")
    assert not is_remote_uri("file:///tmp/ws")
    assert not is_remote_uri(Path("/tmp/ws"))


def test_check_storage_contacts_no_cluster_when_the_answer_is_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    def contacted(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray was contacted")

    # Another test may have Ray up already, so refuse every way in, not only `ray.init`.
    for name in ("init", "is_initialized", "nodes"):
        monkeypatch.setattr(ray, name, contacted)
    # Without an address (a local Ray), with shared storage or a remote URI, no Ray is started.
    check_storage(RayConfig(), "/data/ws")
    check_storage(RayConfig(address="10.255.255.1:6379", shared_storage=True), "/data/ws")
    check_storage(RayConfig(address="10.255.255.1:6379"), "s3://bucket/ws")
    with pytest.raises(AssertionError, match="Ray was contacted"):  # the guard does catch it
        check_storage(RayConfig(address="127.0.0.1:6379"), "/data/ws")


def test_shared_storage_defaults_to_false_and_is_described() -> None:
    field = RayConfig.model_fields["shared_storage"]
    assert RayConfig().shared_storage is False
    assert "NFS" in (field.description or "")


def test_local_ray_workers_get_one_thread_without_a_job_runtime_env(ray_session: str) -> None:
    """The variables reach the workers through the raylet's environment, not a runtime_env.

    A job runtime_env would keep Ray from using the workers it prestarts for this driver.
    """
    import os

    import ray

    def worker_view() -> tuple[str | None, str | None]:  # pickled by value: tests/ is no package
        return os.environ.get("OMP_NUM_THREADS"), os.environ.get("TOKENIZERS_PARALLELISM")

    assert ray.get_runtime_context().runtime_env == {}
    views = ray.get([ray.remote(worker_view).remote() for _ in range(4)])
    assert set(views) == {("1", "false")}


def test_environment_block_restores_set_and_absent_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    monkeypatch.setenv("LMPIPE_TEST_SET", "before")
    monkeypatch.delenv("LMPIPE_TEST_ABSENT", raising=False)
    with scoped_environ({"LMPIPE_TEST_SET": "during", "LMPIPE_TEST_ABSENT": "during"}):
        assert os.environ["LMPIPE_TEST_SET"] == "during"
        assert os.environ["LMPIPE_TEST_ABSENT"] == "during"
    assert os.environ["LMPIPE_TEST_SET"] == "before"
    assert "LMPIPE_TEST_ABSENT" not in os.environ


def _ours(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _rays(signum: int, frame: object) -> None:
    raise SystemExit(signum)


@pytest.mark.parametrize(("before", "after"), [(_ours, _ours), ("default", _rays)])
def test_a_python_sigterm_handler_replaced_by_ray_init_is_put_back(
    before: object, after: object
) -> None:
    """What `ray.init` does to SIGTERM (it installs its own), undone only for a Python handler."""
    import signal

    saved = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before == "default" else before)  # type: ignore[arg-type]
        with keep_sigterm_handler():
            signal.signal(signal.SIGTERM, _rays)  # as ray.init starting a local node does
        assert signal.getsignal(signal.SIGTERM) is after
    finally:
        signal.signal(signal.SIGTERM, saved)


def _square(x: int) -> int:
    return x * x


def test_one_work_unit_runs_here_without_starting_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def no_ray(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh CLI process
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    done: list[tuple[int, int]] = []
    local = RayConfig(num_workers=2)
    assert run_units(_square, [7], local, on_done=lambda i, r: done.append((i, r))) == [49]
    assert done == [(0, 49)]
    assert run_units(_square, [], local) == []
    with pytest.raises(AssertionError, match=r"ray.init was called"):
        run_units(_square, [1, 2], local)  # two units of unknown size: worth Ray's workers
    small = 8 << 20  # `ray.local_max_mb`'s default
    assert run_units(_square, [1, 2], local, input_bytes=small) == [1, 4]  # a small input
    with pytest.raises(AssertionError, match=r"ray.init was called"):
        run_units(_square, [1, 2], local, input_bytes=small + 1)
    with pytest.raises(AssertionError, match=r"ray.init was called"):
        run_units(_square, [1, 2], RayConfig(local_max_mb=0), input_bytes=0)  # 0: always Ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(AssertionError, match=r"ray.init was called"):
        run_units(_square, [1], local)  # a cluster is configured: the work goes there


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_v2_or_v1(
    files: dict[str, str], quota: float | None, tmp_path: Path
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota


@pytest.mark.parametrize(
    ("affinity", "quota", "cores"), [(8, None, 8), (8, 2.5, 2), (2, 6.0, 2), (4, 0.5, 1)]
)
def test_usable_cores_are_the_affinity_capped_by_the_quota(
    affinity: int, quota: float | None, cores: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(ray_runtime, "cgroup_cpu_quota", lambda: quota)
    assert usable_cores() == cores
    assert local_ray_cpus(RayConfig(num_workers=2)) == max(2, cores) + 2
    assert local_ray_cpus(RayConfig(num_workers=2, num_cpus=3)) == 3


def test_a_command_asks_the_provided_node_to_start_only_for_a_local_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []

    def provider(num_cpus: int, object_store_mb: int) -> str:
        asked.append((num_cpus, object_store_mb))
        return "127.0.0.1:1"

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_runtime, "_NODE_PROVIDER", [])
    ray_runtime.prepare_local_node(ray_runtime.RayConfig())  # no provider: nothing to ask
    ray_runtime.use_local_node(provider)
    cfg = ray_runtime.RayConfig(num_cpus=3, object_store_mb=512)
    ray_runtime.prepare_local_node(cfg)
    assert asked == [(3, 512)]  # the size `ensure_ray` would start a local Ray with
    ray_runtime.prepare_local_node(cfg, 8 << 20)  # a corpus the stages keep in the command
    assert asked == [(3, 512)]
    ray_runtime.prepare_local_node(cfg, (8 << 20) + 1)
    assert asked == [(3, 512)] * 2
    asked.pop()
    ray_runtime.prepare_local_node(ray_runtime.RayConfig(address="127.0.0.1:6379"))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    ray_runtime.prepare_local_node(cfg)
    assert asked == [(3, 512)]  # a configured cluster is joined as it is
