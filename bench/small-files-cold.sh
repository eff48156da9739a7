#!/usr/bin/env bash
# Cold 128 KiB files through mounts of two builds side by side, against the same files in a
# local directory: one demo cluster (started with the second build), the version imported
# with three replicas, one mount per build on node1 (kernel opens), and rounds that read
# the local directory and each mount, in an order that turns every round, with the page
# cache dropped before each read.
# The mounts stay up between rounds, as a training job's do between epochs.
#
#     bench/small-files-cold.sh OLD_LOCUS NEW_LOCUS [TRANSPORT] [ROUNDS] [READERS] [FILES]
#
# TRANSPORT is io-uring (default; the fuse module's enable_uring is switched on for the
# run and put back) or dev-fuse, or OLD's and NEW's apart (`dev-fuse,io-uring`: the same
# build on both sides compares the transports). FILES (default 7,000, about the most the demo's 1 GiB
# nodes hold) sets how long one read lasts: 2,000 files take a third of a second at these
# rates, short enough that one round of the same build moved by ±0.15× raw, and fit in
# what a mount keeps open, which hid a second pass's cost (bench/RESULTS.md session 25).
# Judge by the medians printed last, of runs in both orders (OLD NEW, then NEW OLD): the
# two mounts' places are not neutral even with the read order rotating (a build was ahead
# in 11 of 14 rounds as OLD and 10 of 20 as NEW, bench/RESULTS.md session 26). Needs root (dropping caches, FUSE), gcc and python3.
set -euo pipefail
. "$(dirname "$0")/demo-lib.sh"
old=${1:?usage: $0 OLD_LOCUS NEW_LOCUS [TRANSPORT[,TRANSPORT]] [ROUNDS] [READERS] [FILES]}
new=${2:?usage: $0 OLD_LOCUS NEW_LOCUS [TRANSPORT[,TRANSPORT]] [ROUNDS] [READERS] [FILES]}
transport=${3:-io-uring}
rounds=${4:-6}
readers=${5:-8}
files=${6:-7000}
[ "$(id -u)" = 0 ] || { echo "needs root (drop_caches, FUSE)" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
bench_work small-cold m-old m-new
t_old=${transport%,*}
t_new=${transport#*,}
case "$t_old $t_new" in *io-uring*) echo Y > "$uring" ;; esac

gcc -O2 -pthread -o "$work/reader" "$here/cold_reader.c"
make_files "$work/src" "$files" $((128 << 10))
# The demo's nodes re-verify their blobs in the background (64 MiB/s each by default): 3
# nodes reading ~40 MiB/s from the same disk moved the per-read latency of every row.
export LOCUS_NODE_SCRUB_RATE=${LOCUS_NODE_SCRUB_RATE:-0}
start_demo "$new" "$work/demo"
"$new" dataset import small "$work/src" --replicas 3 > /dev/null
mount_builds "$old" "$new" small@1 "$work" --fuse-transport "$t_old"
if [ "$t_new" != "$t_old" ]; then
    fusermount3 -u "$work/m-new"
    "$new" mount small@1 "$work/m-new" --node-socket "$work/demo/node1.sock" --fuse-transport "$t_new" > /dev/null
fi

echo "cold 128 KiB files, $readers readers, $files files, transport old $t_old, new $t_new"
echo "| round | local directory files/s | old files/s (× raw) | new files/s (× raw) |"
echo "|---|---|---|---|"
: > "$work/rounds"
for r in $(seq "$rounds"); do
    # The mount read right after the local directory did better, whichever build it
    # ran (medians 0.77-0.79x against 0.69-0.75x in two runs with the builds swapped),
    # and what is read first in a round may find the host's cache in another state: all
    # three take turns at every place, so six rounds put each at each place twice.
    orders=("src m-old m-new" "m-new src m-old" "m-old m-new src" "src m-new m-old" "m-old src m-new" "m-new m-old src")
    order=${orders[$(( (r - 1) % 6 ))]}
    declare -A got=()
    for d in $order; do
        sync
        echo 3 > /proc/sys/vm/drop_caches
        got[$d]=$("$work/reader" "$readers" "$work/$d" 0 "$files")
    done
    row=("${got[src]}" "${got[m-old]}" "${got[m-new]}")
    echo "${row[*]}" >> "$work/rounds"
    python3 -c "import sys; raw, o, n = map(float, sys.argv[2:]); print(f'| {sys.argv[1]} | {raw:.0f} | {o:.0f} ({o/raw:.2f}×) | {n:.0f} ({n/raw:.2f}×) |')" "$r" "${row[@]}"
done
python3 - "$work/rounds" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
old = [o / raw for raw, o, _ in rows]
new = [n / raw for raw, _, n in rows]
print(f"medians: old {statistics.median(old):.2f}× raw (range {min(old):.2f}–{max(old):.2f}), "
      f"new {statistics.median(new):.2f}× raw (range {min(new):.2f}–{max(new):.2f})")
PY
