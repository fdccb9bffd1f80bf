"""The OpenAI gateway measured (named gateway.py, not openai.py: a bench script of that name would shadow
the `openai` package for every script in bench/): automatic prefix caching's time to first token, and the gateway's cost
against `l4m run` and the executor alone.

    python bench/gateway.py                       # both parts on the embedded default model
    python bench/gateway.py --part prefix --repeats 5 --system-tokens 1000

`prefix`: one `l4m up` with its gateway; chat requests through the official `openai` package, greedy,
streamed. Each repeat takes a fresh system prompt of about `--system-tokens` tokens (random words, so no
earlier repeat has it cached) and sends, one after the other: (cold) system + question A, the first time
that prompt is seen; (warm) system + question B, which finds the system prompt's pages cached; (again)
system + question A once more, whose answer must equal the cold one token for token. Prints the median
time to first token of each kind and cold / warm, and the cached prompt tokens `usage` reported.

`throughput`: bench/e2e.py's sweep with engines l4m-executor, l4m and l4m-gateway (N streams of
token-exact prompts as streamed `/v1/completions`; chat requests cannot carry token-exact prompts), the
ratios gateway / l4m run printed by it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import e2e  # noqa: E402  (bench/e2e.py: the stack's config and the throughput sweep)

from l4m.cluster import Cluster, ClusterConfig  # noqa: E402

WORDS = ["river", "stone", "market", "window", "garden", "letter", "winter", "silver", "forest", "engine", "harbor",
         "candle", "mountain", "paper", "bridge", "orange", "violin", "planet", "shadow", "castle", "ladder", "meadow",
         "island", "pocket", "thunder", "velvet"]
QUESTIONS = ("In one sentence, what is the first word above?", "Name two of the words above, nothing else.")


def system_prompt(seed: int | str, num_tokens: int) -> str:
    rng = random.Random(seed)
    # About one token per word plus its space for these common words (SmolLM2's tokenizer).
    return "Remember these words: " + " ".join(rng.choice(WORDS) for _ in range(num_tokens)) + "."


async def chat(client, model: str, system: str, question: str, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed greedy chat request: its time to first content, its text and its usage."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    start = time.perf_counter()
    stream = await client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True})
    ttft_s, text, usage = None, "", None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - start
                text += choice.delta.content
        usage = chunk.usage or usage
    return {"ttft_s": ttft_s if ttft_s is not None else time.perf_counter() - start, "text": text,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


async def prefix_part(args: argparse.Namespace) -> dict[str, object]:
    import openai

    config = ClusterConfig(state_dir=Path(args.state_dir), spawner_port=args.spawner_port,
                           scheduler_port=args.scheduler_port, gateway_port=args.gateway_port,
                           metrics_port_base=args.metrics_port_base, echo_logs=False)
    cluster = Cluster(config, say=lambda line: print(line, flush=True))
    await cluster.start()
    rows = []
    try:
        client = openai.AsyncOpenAI(base_url=f"{config.gateway_url}/v1", api_key=config.admin_key() or "none",
                                    max_retries=0, timeout=600)
        model = (await client.models.list()).data[0].id
        await chat(client, model, system_prompt("warm-up", 64), QUESTIONS[0], 2)  # tokenizer built, imports done
        for repeat in range(args.repeats):
            system = system_prompt(args.seed + repeat, args.system_tokens)
            cold = await chat(client, model, system, QUESTIONS[0], args.max_tokens)
            warm = await chat(client, model, system, QUESTIONS[1], args.max_tokens)
            again = await chat(client, model, system, QUESTIONS[0], args.max_tokens)
            row = {"repeat": repeat, "prompt_tokens": cold["prompt_tokens"],
                   "cold_ttft_ms": 1000 * cold["ttft_s"], "warm_ttft_ms": 1000 * warm["ttft_s"],
                   "again_ttft_ms": 1000 * again["ttft_s"], "cold_cached": cold["cached_tokens"],
                   "warm_cached": warm["cached_tokens"], "again_cached": again["cached_tokens"],
                   "identical": again["text"] == cold["text"]}
            rows.append(row)
            print(f"  repeat {repeat}: {row['prompt_tokens']} prompt tokens; TTFT cold {row['cold_ttft_ms']:.0f} ms "
                  f"(cached {row['cold_cached']}), warm {row['warm_ttft_ms']:.0f} ms (cached {row['warm_cached']}), "
                  f"again {row['again_ttft_ms']:.0f} ms (cached {row['again_cached']}); "
                  f"answer identical: {row['identical']}", flush=True)
        await client.close()
    finally:
        await cluster.stop()
    cold_ms = statistics.median(r["cold_ttft_ms"] for r in rows)
    warm_ms = statistics.median([r["warm_ttft_ms"] for r in rows] + [r["again_ttft_ms"] for r in rows])
    summary = {"cold_ttft_ms": round(cold_ms, 1), "warm_ttft_ms": round(warm_ms, 1),
               "speedup": round(cold_ms / warm_ms, 2), "all_identical": all(r["identical"] for r in rows)}
    print("| prompt tokens | TTFT cold ms | TTFT cached ms | cold / cached | answers identical |")
    print("|---:|---:|---:|---:|---|")
    print(f"| {statistics.median(r['prompt_tokens'] for r in rows):.0f} | {cold_ms:.0f} | {warm_ms:.0f} | "
          f"{cold_ms / warm_ms:.1f}x | {summary['all_identical']} |", flush=True)
    return {"rows": rows, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("prefix", "throughput", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1000, help="about this many tokens of system prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", default="1,16,64", help="throughput: concurrent streams")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="throughput: prompt length")
    parser.add_argument("--new-tokens", type=int, default=64, help="throughput: tokens per stream")
    parser.add_argument("--state-dir", default="/tmp/l4m-gateway-bench")
    parser.add_argument("--spawner-port", type=int, default=7520)
    parser.add_argument("--scheduler-port", type=int, default=7521)
    parser.add_argument("--gateway-port", type=int, default=7522)
    parser.add_argument("--metrics-port-base", type=int, default=9520)
    parser.add_argument("--out", default="bench/results/gateway.json")
    args = parser.parse_args()
    results: dict[str, object] = {"args": vars(args)}
    if args.part in ("prefix", "all"):
        results["prefix"] = asyncio.run(prefix_part(args))
    if args.part in ("throughput", "all"):
        e2e_out = Path(args.out).with_suffix(".e2e.json")
        subprocess.run([sys.executable, str(BENCH_DIR / "e2e.py"), "--n", args.n, "--prompt-tokens",
                        str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                        "--engines", f"l4m-executor,l4m,{e2e.GATEWAY_ENGINE}", "--repeats", "2",
                        "--state-dir", args.state_dir, "--spawner-port", str(args.spawner_port),
                        "--scheduler-port", str(args.scheduler_port), "--gateway-port", str(args.gateway_port),
                        "--metrics-port-base", str(args.metrics_port_base), "--out", str(e2e_out)], check=True)
        results["throughput"] = json.loads(e2e_out.read_text())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
