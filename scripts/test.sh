#!/usr/bin/env bash
# One command for the tests: installs what they need (Debian) and runs every unit and
# end-to-end test of the workspace. The end-to-end tests start real `locus` processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
if cargo nextest --version >/dev/null 2>&1; then
  exec cargo nextest run --workspace --no-fail-fast "$@"
else
  exec cargo test --workspace --no-fail-fast "$@"
fi
