#!/usr/bin/env bash
# Fails when protos/ breaks the wire contract of main's previous protos (`buf breaking`, FILE rules of
# buf.yaml), so l4m.v1 changes only on purpose; a deliberate break belongs in a new package (l4m.v2).
#
# The baseline, first that applies:
#   $L4M_BREAKING_AGAINST        any git commit-ish, when set
#   HEAD                         when protos/ has uncommitted changes (they will land on HEAD)
#   merge-base with main         on a branch ahead of main (origin/main, else main)
#   HEAD~1                       otherwise: CI on main tests HEAD against the commit before it
# A shallow clone is deepened by one commit when the remote can be reached. When there is no previous
# commit (first commit, a shallow clone that cannot be deepened, no git at all) it says so and passes.
# Usage: scripts/check-breaking.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
buf=tools/node_modules/.bin/buf
[ -x "$buf" ] || { echo "[breaking] buf is missing ($buf): run scripts/setup.sh" >&2; exit 1; }

commit_of() { git rev-parse -q --verify "$1^{commit}" 2>/dev/null; }

baseline() {  # prints the baseline commit, or nothing when there is none
  if [ -n "${L4M_BREAKING_AGAINST:-}" ]; then
    commit_of "$L4M_BREAKING_AGAINST" || { echo "[breaking] L4M_BREAKING_AGAINST=$L4M_BREAKING_AGAINST is no commit" >&2; exit 1; }
    return
  fi
  if ! git diff --quiet HEAD -- protos || [ -n "$(git ls-files --others --exclude-standard protos)" ]; then
    commit_of HEAD
    return
  fi
  local head main base
  head=$(commit_of HEAD)
  for main in origin/main main; do
    base=$(git merge-base HEAD "$main" 2>/dev/null) || continue
    if [ "$base" != "$head" ]; then echo "$base"; return; fi
    break
  done
  if [ -z "$(commit_of HEAD~1)" ] && [ "$(git rev-parse --is-shallow-repository)" = true ]; then
    git fetch -q --deepen=1 2>/dev/null || true
  fi
  commit_of HEAD~1 || true
}

if ! git rev-parse --git-dir >/dev/null 2>&1 || [ -z "$(commit_of HEAD)" ]; then
  echo "[breaking] not a git checkout with commits: no previous protos to compare with, check skipped"
  exit 0
fi
against=$(baseline)
if [ -z "$against" ]; then
  echo "[breaking] no previous commit to compare with (first commit, or a shallow clone that could not be deepened): check skipped"
  exit 0
fi
if ! git cat-file -e "$against:protos" 2>/dev/null; then
  echo "[breaking] ${against:0:12} has no protos/: nothing to compare with, check skipped"
  exit 0
fi
echo "[breaking] protos/ against ${against:0:12} ($(git log -1 --format=%s "$against" | cut -c1-60))"
"$buf" breaking protos --against ".git#ref=$against,subdir=protos"
