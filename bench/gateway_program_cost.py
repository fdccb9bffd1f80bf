"""The cost of answering through a stored program (sandboxed) instead of the built-in handler (in process):
time to first token and total, for the same streamed greedy chat completion, one request at a time.

  l4m up &                                   # or any cluster with a gateway
  .venv/bin/python bench/gateway_program_cost.py [--repeats 5] [--max-tokens 32]

It stores examples/controllers/openai_program.py (tag `bench-answer`) with the admin's key, then alternates
the two models, and prints the median and range of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import openai

from l4m.client import Client
from l4m.keys import ADMIN_KEY_FILE_NAME
from l4m.up import default_state_dir

PROGRAM = Path(__file__).resolve().parents[1] / "examples" / "controllers" / "openai_program.py"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def timed(client: openai.OpenAI, model: str, max_tokens: int) -> tuple[float, float, str]:
    """(seconds to the first piece of text, seconds in all, the text) of one streamed answer."""
    start, first, text = time.perf_counter(), None, ""
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=max_tokens,
                                                stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first or time.perf_counter()
            text += piece
    return (first or time.perf_counter()) - start, time.perf_counter() - start, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:7412/v1")
    parser.add_argument("--spawner", default="127.0.0.1:7410")
    parser.add_argument("--key-file", type=Path, default=default_state_dir() / ADMIN_KEY_FILE_NAME)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    key = args.key_file.read_text().strip()

    async def store() -> None:
        async with Client(args.spawner, api_key=key) as spawner:
            await spawner.upload_file(PROGRAM, "bench-answer")

    asyncio.run(store())
    client = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=0, timeout=300)
    models = {"built-in handler (in process)": client.models.list().data[0].id,
              "stored program (sandboxed)": "l4m/bench-answer"}
    for model in models.values():
        timed(client, model, args.max_tokens)  # warm up: tokenizer, caches, the spawner's warm pool
    results: dict[str, list[tuple[float, float, str]]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            results[name].append(timed(client, model, args.max_tokens))
    texts = {result[2] for runs in results.values() for result in runs}
    print(f"{args.repeats} repeats, N=1, {args.max_tokens} tokens max, same text: {len(texts) == 1}")
    for name, runs in results.items():
        ttft, total = [r[0] * 1000 for r in runs], [r[1] * 1000 for r in runs]
        print(f"{name:32s} TTFT median {statistics.median(ttft):6.0f} ms ({min(ttft):.0f}-{max(ttft):.0f})   "
              f"total median {statistics.median(total):6.0f} ms ({min(total):.0f}-{max(total):.0f})")


if __name__ == "__main__":
    main()
