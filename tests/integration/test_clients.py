"""The TypeScript and Go clients against a live `l4m up`: each language's examples run as a user runs
them (built from the committed generated stubs), and their output is checked.

  - run_controller (TypeScript, Go): uploads examples/controllers/text_completion.py, launches it and
    streams its messages; its JSON summary must be the one `l4m run` prints for the same arguments.
  - greedy_session (TypeScript): speaks L4M itself (pages, forward_text, GREEDY); its tokens and text
    must equal the Python SDK's greedy completion of the same prompt.
  - the TypeScript client's send / list / terminate, against an echo controller.

The toolchains (node + the npm packages from scripts/setup.sh, go + Debian's Go packages) are required:
a missing one fails the test with what to install, it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import L4M_CLI, REPO, UpCluster, up_cluster

TS_DIR = REPO / "clients" / "typescript"
GO_DIR = REPO / "clients" / "go"
GO_PATH = f"{GO_DIR}:/usr/share/gocode"  # GOPATH roots: ours (clients/go/src/l4m) and Debian's Go packages
PROGRAM = REPO / "examples" / "controllers" / "text_completion.py"
# Long enough to cross KV page boundaries (pages of 16) and to end on a stop token or the length.
PROMPTS = [("What is 2+2?", 8), ("Name three colors.", 40), ("Write one sentence about the sea.", 40)]
RUN_TIMEOUT_S = 120

pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path = REPO, env: dict[str, str] | None = None,
         timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _require(tool: str, how: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: {how} (scripts/setup.sh installs it)")
    return path


def _summary(stdout: str) -> dict:
    """The last line of an example's output: the JSON summary of the completion."""
    return json.loads(stdout.strip().splitlines()[-1])


def _client_env(cluster: UpCluster) -> dict[str, str]:
    """The environment the clients run in: this cluster's admin key in L4M_API_KEY."""
    return {**os.environ, "L4M_API_KEY": cluster.admin_key}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    """`l4m up --allow-anonymous` (greedy_session opens a session with no instance token), metrics off.
    Every client presents the admin key `l4m up` wrote (`_client_env`)."""
    with up_cluster(tmp_path_factory.mktemp("clients"), ["--allow-anonymous"], metrics=False) as up:
        yield up


@pytest.fixture(autouse=True)
def show_logs_on_failure(cluster: UpCluster, request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(cluster.logs())


@pytest.fixture(scope="module")
def typescript_dist() -> Path:
    """The TypeScript client and examples compiled with the project's pinned tsc."""
    _require("node", "install Node.js >= 18")
    tsc = TS_DIR / "node_modules" / ".bin" / "tsc"
    if not tsc.exists():
        pytest.fail(f"{tsc} is missing: run `npm ci` in clients/typescript")
    _run([str(tsc), "-p", str(TS_DIR)], cwd=TS_DIR)
    return TS_DIR / "dist" / "examples"


@pytest.fixture(scope="module")
def go_run_controller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go example built in GOPATH mode against Debian's grpc-go and protobuf packages."""
    go = _require("go", "apt-get install golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev")
    binary = tmp_path_factory.mktemp("go") / "run_controller"
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": GO_PATH, "GOFLAGS": "", "CGO_ENABLED": "0"}
    _run([go, "build", "-o", str(binary), "./clients/go/examples/run_controller"], env=env, timeout_s=300)
    return binary


@pytest.fixture(scope="module")
def python_summaries(cluster: UpCluster) -> dict[str, dict]:
    """The Python SDK's greedy completion of each prompt, through `l4m run` (the reference)."""
    summaries = {}
    for prompt, max_tokens in PROMPTS:
        proc = _run([str(L4M_CLI), "run", "--spawner", cluster.spawner_address, str(PROGRAM), "--",
                     "--no-stream", "--max-tokens", str(max_tokens), prompt], env=_client_env(cluster))
        summaries[prompt] = _summary(proc.stdout)
    return summaries


@pytest.fixture(params=["typescript", "go"])
def run_controller(request: pytest.FixtureRequest, cluster: UpCluster) -> list[str]:
    """The command line of one language's run_controller example, up to the program's path."""
    if request.param == "typescript":
        dist = request.getfixturevalue("typescript_dist")
        return ["node", str(dist / "run_controller.js"), "--spawner", cluster.spawner_address]
    return [str(request.getfixturevalue("go_run_controller")), "-spawner", cluster.spawner_address]


def test_run_controller_streams_what_l4m_run_prints(run_controller: list[str], cluster: UpCluster,
                                                    python_summaries: dict[str, dict]) -> None:
    prompt, max_tokens = PROMPTS[0]
    proc = _run([*run_controller, str(PROGRAM), "--", "--max-tokens", str(max_tokens), prompt], env=_client_env(cluster))
    lines = proc.stdout.strip().splitlines()
    summary = _summary(proc.stdout)
    assert summary == python_summaries[prompt]
    # Streamed: one message per text chunk before the summary, together spelling the text.
    assert len(lines) > 2 and "".join(lines[:-1]) == summary["text"]


def test_run_controller_reports_a_crash(run_controller: list[str], cluster: UpCluster, tmp_path: Path) -> None:
    crashing = tmp_path / "crashes.py"
    crashing.write_text("async def main(ctx):\n    await ctx.send('before')\n    raise RuntimeError('on purpose')\n")
    proc = subprocess.run([*run_controller, str(crashing)], cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=_client_env(cluster))
    assert (proc.returncode, proc.stdout) == (1, "before\n"), proc.stderr
    assert "RuntimeError: on purpose" in proc.stderr  # the controller's log lines
    assert "the controller ended: EXIT_REASON_CRASHED" in proc.stderr


@pytest.mark.parametrize(("prompt", "max_tokens"), PROMPTS)
def test_typescript_greedy_session_equals_the_python_sdk(
        cluster: UpCluster, typescript_dist: Path, python_summaries: dict[str, dict], prompt: str,
        max_tokens: int) -> None:
    proc = _run(["node", str(typescript_dist / "greedy_session.js"), "--scheduler", cluster.scheduler_address,
                 "--max-tokens", str(max_tokens), prompt])
    summary = _summary(proc.stdout)
    assert summary == python_summaries[prompt]
    assert proc.stdout.startswith(summary["text"])  # streamed before the summary


ECHO_CONTROLLER = """
async def main(ctx):
    await ctx.send("ready")
    while True:
        text = await ctx.receive()
        await ctx.send(f"echo: {text}")
"""

# The client's whole surface from its package entry point: upload, launch, attach, send, list, terminate.
SEND_AND_TERMINATE = """
import { SpawnerClient, spawner } from "%(index)s";
const client = new SpawnerClient(process.argv[1]);
const instanceId = await client.launch(await client.uploadFile(process.argv[2]));
for await (const event of client.attach(instanceId)) {
  if (event.event?.$case === "message") {
    console.log(event.event.value.text);
    if (event.event.value.text === "ready") await client.send(instanceId, "hello");
    else {
      const states = (await client.listInstances()).filter((i) => i.instanceId === instanceId).map((i) => i.state);
      console.log(states.map((s) => spawner.InstanceState[s]).join());
      await client.terminate(instanceId);
    }
  } else if (event.event?.$case === "exit") {
    console.log(spawner.ExitReason[event.event.value.reason]);
  }
}
client.close();
"""


def test_run_controller_without_a_key_is_refused(run_controller: list[str], cluster: UpCluster) -> None:
    env = {k: v for k, v in _client_env(cluster).items() if k != "L4M_API_KEY"}
    proc = subprocess.run([*run_controller, str(PROGRAM)], cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=env)
    assert proc.returncode != 0 and "UNAUTHENTICATED" in proc.stderr.upper().replace(" ", "_"), proc.stderr


def test_typescript_client_sends_and_terminates(cluster: UpCluster, typescript_dist: Path, tmp_path: Path) -> None:
    program = tmp_path / "echo.py"
    program.write_text(ECHO_CONTROLLER)
    script = SEND_AND_TERMINATE % {"index": (typescript_dist.parent / "src" / "index.js").as_uri()}
    proc = _run(["node", "--input-type=module", "-e", script, cluster.spawner_address, str(program)], env=_client_env(cluster))
    assert proc.stdout.splitlines() == ["ready", "echo: hello", "INSTANCE_STATE_RUNNING", "EXIT_REASON_TERMINATED"]
