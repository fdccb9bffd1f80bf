#!/usr/bin/env bash
# The test command: set up (idempotent), then every check CI runs.
#   scripts/test.sh              everything
#   scripts/test.sh tests/unit   just those pytest paths (checks still run)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
echo "[test] generated stubs are current"; scripts/gen-protos.sh --check
if [ -x tools/node_modules/.bin/buf ]; then
  echo "[test] buf lint"; tools/node_modules/.bin/buf lint
fi
echo "[test] buf breaking (protos/ against main's previous protos)"; scripts/check-breaking.sh
echo "[test] ruff"; .venv/bin/ruff check .
echo "[test] pytest"
# pytest exits 5 when it collects nothing: that is a failure here too.
exec .venv/bin/pytest -p no:cacheprovider --durations=25 "${@:-tests}"
