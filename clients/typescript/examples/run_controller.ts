/**
 * Run a Python controller on an l4m cluster and stream its output, like `l4m run`: messages to stdout,
 * log lines to stderr, and the instance's exit status as this process's own.
 *
 *   node dist/examples/run_controller.js --spawner 127.0.0.1:7410 \
 *     ../../examples/controllers/text_completion.py -- --max-tokens 8 "What is 2+2?"
 *
 * The API key comes from $L4M_API_KEY (e.g. `export L4M_API_KEY=$(cat /tmp/l4m-$USER/admin.key)`).
 */
import { parseArgs } from "node:util";

import { SpawnerClient, exitStatus } from "../src/index.js";
import { type AttachResponse, ExitReason } from "../src/gen/l4m/v1/spawner.js";

function printEvent(response: AttachResponse): void {
  const event = response.event;
  if (event?.$case === "message") {
    console.log(event.value.text);
  } else if (event?.$case === "log") {
    console.error(event.value.line);
  } else if (event?.$case === "exit" && event.value.reason !== ExitReason.EXIT_REASON_EXITED) {
    console.error(`l4m: the controller ended: ${ExitReason[event.value.reason]}: ${event.value.message}`);
  }
}

async function main(): Promise<number> {
  const { values, positionals } = parseArgs({
    options: { spawner: { type: "string", default: "127.0.0.1:7410" } },
    allowPositionals: true,
  });
  const [program, ...args] = positionals;
  if (!program) {
    console.error("usage: run_controller.js [--spawner HOST:PORT] PROGRAM.py [-- ARGS...]");
    return 2;
  }
  const client = new SpawnerClient(values.spawner!);
  try {
    return exitStatus(await client.run(program, args, printEvent));
  } finally {
    client.close();
  }
}

main().then(
  (status) => process.exit(status),
  (error: Error) => {
    console.error(`l4m: ${error.message}`);
    process.exit(1);
  },
);
