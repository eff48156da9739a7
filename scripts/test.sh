#!/usr/bin/env bash
# One command for the tests: installs what they need (Debian) and runs every unit and
# end-to-end test of the workspace. The end-to-end tests start real `locus` processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
# The Python sampler's property tests (hypothesis; no torch needed).
python3 -m pytest -q -p no:cacheprovider python/tests
if cargo nextest --version >/dev/null 2>&1; then
  exec cargo nextest run --workspace --no-fail-fast "$@"
else
  exec cargo test --workspace --no-fail-fast "$@"
fi
