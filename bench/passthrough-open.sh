#!/usr/bin/env bash
# What one open of a passthrough file costs through mounts of two builds side by side:
# one demo cluster (started with the second build), a version of 4 MiB files imported
# with three replicas, one mount per build on node1 (`--opens mount
# --passthrough-min-size 0`: every open asks the mount, which passes the file through),
# and rounds that open, read a byte of and close one file 50,000 times through each
# mount in turn. Prints wall time per open and the CPU per open of each mount's holder
# and server (from /proc, the pids from their status files).
#
#     bench/passthrough-open.sh OLD_LOCUS NEW_LOCUS [ROUNDS] [OPENS]
#
# Needs root (FUSE), gcc and python3.
set -euo pipefail
. "$(dirname "$0")/demo-lib.sh"
old=${1:?usage: $0 OLD_LOCUS NEW_LOCUS [ROUNDS] [OPENS]}
new=${2:?usage: $0 OLD_LOCUS NEW_LOCUS [ROUNDS] [OPENS]}
rounds=${3:-3}
opens=${4:-50000}
[ "$(id -u)" = 0 ] || { echo "needs root (FUSE)" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
bench_work pt-open m-old m-new
export LOCUS_RUNTIME_DIR=$work/run

gcc -O2 -o "$work/open_close" "$here/open_close.c"
make_files "$work/src" 4 $((4 << 20))
start_demo "$new" "$work/demo"
"$new" dataset import pt "$work/src" --replicas 3 > /dev/null
mount_builds "$old" "$new" pt@1 "$work" --opens mount --passthrough-min-size 0
for b in old new; do
    "$work/open_close" "$work/m-$b/f00000.bin" 2000 > /dev/null
done

# "HOLDER SERVER" pids of the mount at $1, from its status file.
pids() {
    python3 - "$LOCUS_RUNTIME_DIR/mounts" "$1" <<'PY'
import json, os, sys
for n in os.listdir(sys.argv[1]):
    if n.endswith(".json") and not n.endswith(".session.json"):
        s = json.load(open(os.path.join(sys.argv[1], n)))
        if s.get("mountpoint") == sys.argv[2]:
            print(s["pid"], s["server_pid"])
PY
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

echo "open + 1-byte pread + close of a passthrough file, $opens times per mount and round"
echo "| round | build | µs per open | holder CPU µs per open | server CPU µs per open |"
echo "|---|---|---|---|---|"
for r in $(seq "$rounds"); do
    for b in old new; do
        read -r holder server <<< "$(pids "$work/m-$b")"
        h0=$(ticks "$holder"); s0=$(ticks "$server")
        us=$("$work/open_close" "$work/m-$b/f00000.bin" "$opens")
        h1=$(ticks "$holder"); s1=$(ticks "$server")
        python3 -c "import sys; r,b,us,h,s,n,hz=sys.argv[1:]; f=lambda t: float(t)*1e6/float(hz)/int(n); print(f'| {r} | {b} | {float(us):.1f} | {f(h):.1f} | {f(s):.1f} |')" \
            "$r" "$b" "$us" $((h1 - h0)) $((s1 - s0)) "$opens" "$hz"
    done
done
