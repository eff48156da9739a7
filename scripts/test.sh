#!/usr/bin/env bash
# One command for the tests: installs what they need (Debian) and runs every unit and
# end-to-end test of the workspace. The end-to-end tests start real `locus` processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
# The Python sampler's property tests (hypothesis; no torch needed).
python3 -m pytest -q -p no:cacheprovider python/tests
status=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@" || status=$?
else
  cargo test --workspace --no-fail-fast "$@" || status=$?
fi
# The mount suites again with FUSE over io_uring (`--fuse-transport io-uring` through
# LOCUS_FUSE_TRANSPORT; tests/mount.rs checks each mount's transport is io_uring). The
# kernel parameter is switched on for the pass and put back afterwards. The test that
# switches the parameter itself is left out, as it would pull it from under the others.
uring=/sys/module/fuse/parameters/enable_uring
if [[ $# -eq 0 && -w $uring ]]; then
  was=$(cat "$uring")
  trap 'echo "$was" > "$uring"' EXIT
  echo Y > "$uring"
  echo "== mount tests over FUSE io_uring"
  if cargo nextest --version >/dev/null 2>&1; then
    LOCUS_FUSE_TRANSPORT=io-uring cargo nextest run --no-fail-fast \
      --test mount --test listing --test mount_restart \
      -E 'not test(io_uring_falls_back)' || status=$?
  else
    LOCUS_FUSE_TRANSPORT=io-uring cargo test --no-fail-fast \
      --test mount --test listing --test mount_restart -- \
      --skip io_uring_falls_back || status=$?
  fi
elif [[ $# -eq 0 ]]; then
  echo "== mount tests over FUSE io_uring: NOT RUN ($uring is missing or not writable: needs Linux 6.14+ with CONFIG_FUSE_IO_URING, as root)"
fi
exit $status
