"""Relay benchmark controller: `relay.py NUM_MESSAGES MESSAGE_BYTES` sends NUM_MESSAGES messages of
MESSAGE_BYTES bytes to its user, one `ctx.send` after the other (as a controller streaming tokens does),
then one JSON line: its own CPU and wall seconds over the sends."""

import json
import time


async def main(ctx):
    num_messages, num_bytes = int(ctx.args[0]), int(ctx.args[1])
    payload = "x" * num_bytes
    started, cpu_before = time.perf_counter(), time.process_time()
    for _ in range(num_messages):
        await ctx.send(payload)
    await ctx.flush()  # every message answered by the spawner: its whole cost is in the measurement
    await ctx.send(json.dumps({"cpu_s": time.process_time() - cpu_before, "wall_s": time.perf_counter() - started}))
