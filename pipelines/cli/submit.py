"""`lmpipe submit`: run the pipeline, or one stage, on a Ray cluster as a Ray job.

Usage: `lmpipe submit configs/demo.yaml workspace=/mnt/shared/ws --address http://HEAD:8265`.
The recipe is validated here first; the job then runs on the cluster with this project as its
working directory, and its logs stream here until it ends. The logic is in
`pipelines/ops/submit.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.ops.submit import (
    STAGES,
    SubmitError,
    build_entrypoint,
    build_runtime_env,
    connect,
    follow_job,
    job_commands,
    job_message,
    parse_env,
    project_root,
    recipe_in_project,
    refuse_unshared_storage,
    resolve_address,
    submit,
    validate_recipe,
)

_EXIT_BAD_USAGE = 2
_EXIT_JOB_FAILED = 1
_EXIT_DETACHED = 130  # Ctrl-C while following: the job itself keeps running


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `submit` subcommand."""
    parser = sub.add_parser(
        "submit",
        help="run the pipeline (or one stage) on a Ray cluster as a Ray job",
        description="Validate the recipe here, then submit `lmpipe STAGE CONFIG KEY=VALUE...` "
        "to a Ray cluster as a Ray job, with this project directory as its working_dir. "
        "Prints the job id and the `ray job status/logs/stop` commands, streams the logs "
        "until the job ends, and exits 0 only if it SUCCEEDED. The recipe must be inside the "
        "project directory, the workspace an absolute path every node mounts (set "
        "ray.shared_storage=true for NFS or a one-host cluster). See docs/cluster.md.",
    )
    parser.add_argument("config", type=Path, help="YAML recipe inside the project (configs/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. workspace=/mnt/ws"
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the head's dashboard URL, http://HEAD:8265; default $RAY_API_SERVER_ADDRESS, "
        "or $RAY_ADDRESS when it is an http(s) URL",
    )
    parser.add_argument(
        "--stage", choices=STAGES, default="run", help="the lmpipe command to run (default: run)"
    )
    parser.add_argument(
        "--no-wait", action="store_true", help="print the job id and return once submitted"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra environment variable for the job (shown in the dashboard: no secrets)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="also leave these paths out of the uploaded project (gitignore syntax)",
    )
    parser.set_defaults(func=run_submit)


def run_submit(args: argparse.Namespace) -> int:
    """Submit the job and follow it; return the exit code (0 only when it SUCCEEDED)."""
    try:
        address = resolve_address(args.address, os.environ)
        root = project_root()
        recipe = recipe_in_project(args.config, root)
        cfg = validate_recipe(root, recipe, args.overrides)
        runtime_env = build_runtime_env(root, os.environ, parse_env(args.env), args.exclude)
        entrypoint = build_entrypoint(args.stage, recipe, args.overrides)
        client = connect(address)
        refuse_unshared_storage(cfg, address)
        metadata = {"lmpipe.name": cfg.name, "lmpipe.stage": args.stage, "lmpipe.recipe": recipe}
        job_id = submit(client, entrypoint, runtime_env, metadata)
    except SubmitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_BAD_USAGE
    print(f"submitted Ray job {job_id}: {entrypoint}")
    for command in job_commands(address, job_id):
        print(f"  {command}")
    sys.stdout.flush()
    if args.no_wait:
        return 0
    try:
        status = follow_job(client, job_id, sys.stdout)
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} keeps running (ray job stop to end it)")
        return _EXIT_DETACHED
    if status == "SUCCEEDED":
        print(f"job {job_id} SUCCEEDED")
        return 0
    print(f"job {job_id} {status}: {job_message(client, job_id)}", file=sys.stderr)
    return _EXIT_JOB_FAILED
