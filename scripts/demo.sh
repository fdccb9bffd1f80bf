#!/usr/bin/env bash
# The run command: set up (idempotent), start the cluster on the embedded default (CPU, SmolLM2-135M),
# run the text-completion controller through the spawner, print its output, stop the cluster.
#   scripts/demo.sh                      the default prompt
#   scripts/demo.sh --prompt "..."       your prompt (any `l4m demo` flag works: l4m demo --help)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
exec .venv/bin/l4m demo "$@"
