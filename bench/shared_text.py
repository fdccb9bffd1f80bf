"""Launches that share a controller process and tokenize (issue #19): how long N of them take with the process's
one tokenizer (`l4m.model.TOKENIZERS`, by `ModelInfo.tokenizer_sha256`) against each instance building its own.

N launches of `bench/controllers/text.py` (it tokenizes a prompt, generates `--new-tokens` greedily and sends
the text), all with `share_process`, on a cluster started like `l4m up` (`--max-instances-per-process` at
least N, so that they share one process). Variant `shared` is the program as is; `each` is the same program
with the process's tokenizer cache turned off at its top (`TOKENIZERS.max_entries = 0`), so each instance
fetches and builds its own, as before the cache. Rounds alternate the variants' order (`--repeats`); the
table shows, per variant, the time from the first request to the last instance's exit.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/shared_text.py
    .venv/bin/python bench/shared_text.py --n 4 --repeats 1 --new-tokens 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from l4m.client import Client  # noqa: E402
from l4m.cluster import Cluster, ClusterConfig  # noqa: E402
from l4m.v1 import spawner_pb2  # noqa: E402

CONTROLLER = Path(__file__).parent / "controllers" / "text.py"
NO_CACHE = "import l4m.model\nl4m.model.TOKENIZERS.max_entries = 0  # each instance builds its own\n"
VARIANTS = ("shared", "each")


async def one_round(client: Client, program: str, n: int, new_tokens: int) -> dict[str, float]:
    """N shared launches at once; seconds from the first request to each exit, and the texts."""
    start = time.perf_counter()

    async def one(i: int) -> tuple[float, str]:
        instance_id = await client.launch(program, [f"Write one word about the sea ({i}).", str(new_tokens)],
                                          share_process=True)
        text = ""
        async for event in client.attach(instance_id):
            kind = event.WhichOneof("event")
            if kind == "message":
                text = event.message.text
            elif kind == "exit" and (event.exit.reason != spawner_pb2.EXIT_REASON_EXITED or event.exit.exit_code):
                raise RuntimeError(f"{instance_id} ended {spawner_pb2.ExitReason.Name(event.exit.reason)}: "
                                   f"{event.exit.message}")
        return time.perf_counter() - start, text

    ends = await asyncio.gather(*(one(i) for i in range(n)))
    if any(not text for _, text in ends):
        raise RuntimeError("an instance ended without sending its text")
    return {"last_exit_s": max(t for t, _ in ends), "median_exit_s": statistics.median(t for t, _ in ends)}


async def bench(args: argparse.Namespace) -> list[dict[str, object]]:
    config = ClusterConfig(state_dir=Path(args.state_dir), spawner_port=args.spawner_port, gateway_port=-1,
                           scheduler_port=args.scheduler_port, metrics_port_base=0, echo_logs=False,
                           max_instances_per_process=max(args.n, 2), models=(args.model,) if args.model else ())
    cluster = Cluster(config, say=lambda line: None)
    rows: list[dict[str, object]] = []
    try:
        await cluster.start()
        async with Client(config.spawner_address, api_key=config.admin_key() or None) as client:
            source = CONTROLLER.read_text()
            programs = {"shared": await client.upload(source.encode(), "text.py"),
                        "each": await client.upload((NO_CACHE + source).encode(), "text_each.py")}
            await one_round(client, programs["shared"], 1, 1)  # warm-up: the executor's first batch
            for repeat in range(args.repeats):
                for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                    row = {"variant": variant, "n": args.n, **await one_round(client, programs[variant], args.n,
                                                                              args.new_tokens)}
                    rows.append(row)
                    print(f"{variant:<8} {args.n:>4} {row['last_exit_s']:>12.2f} {row['median_exit_s']:>14.2f}",
                          flush=True)
    finally:
        await cluster.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16, help="launches that share one process")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4, help="rounds, the variants' order alternating")
    parser.add_argument("--state-dir", default="/tmp/l4m-shared-text-bench")
    parser.add_argument("--spawner-port", type=int, default=7710)
    parser.add_argument("--scheduler-port", type=int, default=7711)
    parser.add_argument("--model", default="", help="what the cluster serves (`l4m up --model`; default SmolLM2)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.n < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--n, --new-tokens and --repeats must be at least 1")
    print(f"{args.n} shared launches that tokenize, cpus={len(os.sched_getaffinity(0))}; seconds from the first "
          "request")
    print(f"{'variant':<8} {'n':>4} {'last exit s':>12} {'median exit s':>14}")
    rows = asyncio.run(bench(args))
    for variant in VARIANTS:
        lasts = [r["last_exit_s"] for r in rows if r["variant"] == variant]
        print(f"{variant}: median of {len(lasts)} rounds {statistics.median(lasts):.2f} s "
              f"(min {min(lasts):.2f}, max {max(lasts):.2f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
