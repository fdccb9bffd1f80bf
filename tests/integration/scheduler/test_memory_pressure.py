"""Memory pressure through a real `l4m up` (SmolLM2 on CPU, a KV cache of 8 pages and one that a pinned
export holds, host swap): four child
controllers whose KV needs total twice the cache decode at once; the scheduler preempts (swaps out) and
resumes them instead of trapping anyone, and each gets exactly the tokens it gets when run alone. Two
persistent exports made before wait beside them: the unpinned one is evicted (before anyone is preempted),
the pinned one stays."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.harness import L4M_CLI, REPO, CliRun, UpCluster, service_env, up_cluster

pytestmark = pytest.mark.slow

NUM_PAGES = 8  # of 16 token slots
# One more page, held by the pinned export throughout (the children contend for the 8 above, as they would
# without it); the unpinned export's page is evicted at the first shortfall.
NUM_PINNED_PAGES = 1
# Each child: a prompt of one page, then 47 generated tokens: 4 pages; four children need 16, twice the cache.
PROMPTS = ["The history of the river", "A recipe for bread starts", "In the year 1900 the city", "Dear diary, today I"]
NUM_TOKENS = 47

PROGRAM = """
import json

from l4m import Greedy
from l4m.stop import MaxTokens


async def generate(ctx, prompt, num_tokens, fill_to_page):
    async with ctx.new_context() as context:
        context.fill(prompt)
        context.flush()
        if fill_to_page is not None:  # every child holds its prompt's page before any of them decodes
            await ctx.vars.set(f"ready/{fill_to_page}", "1")
            await ctx.vars.wait_for("go")
        completion = await context.generate(Greedy(), stop=MaxTokens(num_tokens))
        return completion.token_ids


async def main(ctx):
    mode, *rest = ctx.args
    num_tokens = int(rest[0])
    prompts = rest[1:]
    if mode == "child":
        index = int(prompts[0])
        tokens = await generate(ctx, prompts[1], num_tokens, index)
        await ctx.vars.set(f"tokens/{index}", json.dumps(tokens))
    else:
        # Alone: one prompt after the other, in this instance, before any child exists (nothing to contend with).
        alone = [await generate(ctx, p, num_tokens, None) for p in prompts]
        stats_alone = await ctx.model.scheduler_stats()
        for name, pinned in (("loose", False), ("kept", True)):  # a page each, held by the export alone
            async with ctx.new_context() as context:
                context.fill(prompts[0])
                await context.export(name, persistent=True, pinned=pinned)
        # Together: one child per prompt, launched in order, released together.
        children = [await ctx.spawn(args=["child", str(num_tokens), str(i), p]) for i, p in enumerate(prompts)]
        for i in range(len(prompts)):
            await ctx.vars.wait_for(f"ready/{i}")
        await ctx.vars.set("go", "1")
        exits = [await child.wait(timeout_s=150) for child in children]
        tokens = [json.loads((await ctx.vars.get(f"tokens/{i}")).text) if e is not None and e.is_success else None
                  for i, e in enumerate(exits)]
        exports = {e.name: e.pinned for e in await ctx.model.list_exports()}
        await ctx.send(json.dumps({"alone": alone, "preemptions_alone": stats_alone["preemptions"],
                                   "exports": exports,
                                   "tokens": tokens, "exits": [
            "ok" if e is not None and e.is_success else e and f"{e.reason}: {e.message}" for e in exits]}))
"""


def _run(up: UpCluster, program: Path, *args: str) -> CliRun:
    argv = [str(L4M_CLI), "run", "--spawner", up.spawner_address, "--api-key-file", str(up.admin_key_path),
            str(program), "--", *args]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=180)
    return CliRun(argv, proc.returncode, proc.stdout, proc.stderr)


def test_twice_the_cache_runs_to_the_end_with_the_tokens_each_gets_alone(tmp_path: Path) -> None:
    program = tmp_path / "pressure.py"
    program.write_text(PROGRAM)
    args = ["--num-pages", str(NUM_PAGES + NUM_PINNED_PAGES), "--swap-space-pages", "32", "--gateway-port", "-1"]
    with up_cluster(tmp_path, args) as up:
        runs: list[CliRun] = []
        try:
            together = _run(up, program, "parent", str(NUM_TOKENS), *PROMPTS)
            runs.append(together)
            assert together.returncode == 0
            result = json.loads(together.lines[-1])
            assert [len(t) for t in result["alone"]] == [NUM_TOKENS] * len(PROMPTS)
            assert result["preemptions_alone"] == 0
            assert result["exits"] == ["ok"] * len(PROMPTS)
            assert result["tokens"] == result["alone"]  # only a delay: exactly the tokens each gets alone
            assert result["exports"] == {"kept": True}  # "loose" was evicted, the pinned one stayed
            metrics = up.metrics("scheduler")
            assert metrics.value("l4m_scheduler_exports_evicted_total") == 1
            assert metrics.value("l4m_scheduler_export_kv_pages_evicted_total") == 1
            assert metrics.value("l4m_scheduler_preemptions_total") > 0
            assert metrics.value("l4m_scheduler_resumes_total") == metrics.value("l4m_scheduler_preemptions_total")
            assert metrics.value("l4m_scheduler_traps_total", 0, kind="TRAP_KIND_EVICTED") == 0
            assert metrics.value("l4m_scheduler_traps_total", 0, kind="TRAP_KIND_RESOURCE_EXHAUSTED") == 0
            assert metrics.value("l4m_scheduler_kv_pages_swapped") == 0
            assert metrics.value("l4m_scheduler_admission_queue_depth") == 0
        except BaseException:
            for run in runs:
                print(run.describe())
            print(up.logs())
            raise
