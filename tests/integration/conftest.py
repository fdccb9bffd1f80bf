"""Shared fixtures for integration tests: real processes on loopback, logs printed when a test fails.

`l4m_up` (session-scoped) is the real `l4m up` command on free ports with its own state directory:
executor (SmolLM2 on CPU), scheduler and spawner with bubblewrap sandboxes, metrics endpoints on. `l4m_run`
runs the real `l4m run FILE -- ARGS` against it, as a user does (with the admin key `l4m up` wrote, unless
the options name another), and keeps its exit status, stdout (the controller's messages, one per line)
and stderr (its log lines and, on an abnormal end, the reason). `UpCluster.add_user_key` makes a user's
key with `l4m keys add`.

How processes are started (ports, services, `l4m up`) lives in harness.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.integration.harness import L4M_CLI, REPO, CliRun, UpCluster, service_env, up_cluster


@pytest.fixture(scope="session")
def l4m_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    with up_cluster(tmp_path_factory.mktemp("l4m-up")) as cluster:
        yield cluster


@pytest.fixture
def l4m_run(l4m_up: UpCluster, request: pytest.FixtureRequest) -> Iterator[Callable[..., CliRun]]:
    runs: list[CliRun] = []

    def run(program: str | Path, *args: str, options: Sequence[str] = (), timeout_s: float = 300) -> CliRun:
        """`l4m run [OPTIONS] PROGRAM -- ARGS`, as the admin unless OPTIONS give `--api-key-file`."""
        key = [] if "--api-key-file" in options else ["--api-key-file", str(l4m_up.admin_key_path)]
        argv = [str(L4M_CLI), "run", "--spawner", l4m_up.spawner_address, *key, *options, str(program), "--", *args]
        proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=timeout_s)
        result = CliRun(argv, proc.returncode, proc.stdout, proc.stderr)
        runs.append(result)
        return result

    yield run
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for result in runs:
            print(result.describe())
        print(l4m_up.logs())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
