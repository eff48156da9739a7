#!/usr/bin/env bash
# One command for the demo: installs what the build needs (Debian), builds `locus` and
# runs `locus demo`, a throwaway local cluster on the embedded defaults. Extra arguments
# go to `locus demo` (e.g. --keep-running, --dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
exec cargo run --quiet --bin locus -- demo "$@"
