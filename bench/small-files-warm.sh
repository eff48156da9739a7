#!/usr/bin/env bash
# Warm 128 KiB files through a mount, against the same files in a local directory: one
# demo cluster, the version imported with three replicas, two mounts of one build on
# node1 (`--opens kernel`: the kernel opens and reads from its page cache; `--opens
# mount`: the mount server answers every OPEN, READ and RELEASE), every file read once
# before measuring. Each figure is the mean of PASSES passes; besides files/s it prints
# the CPU the mount server spent and the machine was busy (all CPUs, /proc/stat), per
# file, so a ratio can be told apart from the host's noise.
#
#     bench/small-files-warm.sh LOCUS [TRANSPORT] [ROUNDS] [READERS] [FILES] [PASSES]
#
# TRANSPORT is io-uring (default; the fuse module's enable_uring is switched on for the
# run and put back) or dev-fuse. Needs root (FUSE), gcc and python3.
set -euo pipefail
. "$(dirname "$0")/demo-lib.sh"
bin=${1:?usage: $0 LOCUS [TRANSPORT] [ROUNDS] [READERS] [FILES] [PASSES]}
transport=${2:-io-uring}
rounds=${3:-3}
readers=${4:-8}
files=${5:-2000}
passes=${6:-10}
[ "$(id -u)" = 0 ] || { echo "needs root (FUSE)" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
bench_work small-warm m-kernel m-mount
[ "$transport" = io-uring ] && echo Y > "$uring"

gcc -O2 -pthread -o "$work/reader" "$here/cold_reader.c"
make_files "$work/src" "$files" $((128 << 10))
export LOCUS_NODE_SCRUB_RATE=${LOCUS_NODE_SCRUB_RATE:-0}
start_demo "$bin" "$work/demo"
"$bin" dataset import small "$work/src" --replicas 3 > /dev/null
declare -A server=()
for o in kernel mount; do
    mkdir -p "$work/m-$o"
    "$bin" mount small@1 "$work/m-$o" --node-socket "$work/demo/node1.sock" \
        --fuse-transport "$transport" --opens "$o" > /dev/null
    server[$o]=$(pgrep -n -f "mount small@1 $work/m-$o .*--serve")
done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
# files/s of PASSES reads of $1, one a line in $work/got (nothing else runs between the
# reads: a python3 start per pass was most of the busy time measured)
passes_of() {
    local i
    for i in $(seq "$passes"); do "$work/reader" "$readers" "$1" 0 "$files"; done > "$work/got"
}
mean_got() { python3 -c "import sys; v = [float(l) for l in open(sys.argv[1])]; print(sum(v) / len(v))" "$work/got"; }
for d in src m-kernel m-mount; do "$work/reader" "$readers" "$work/$d" 0 "$files" > /dev/null; done

hz=$(getconf CLK_TCK)
per_file() { python3 -c "print(round($1 * 1e6 / $hz / ($files * $passes)))"; }
echo "warm 128 KiB files, $readers readers, $files files, $passes passes a figure, transport $transport"
echo "| round | local files/s (busy µs/file) | --opens kernel × raw (busy, server µs/file) | --opens mount × raw (busy, server µs/file) |"
echo "|---|---|---|---|"
: > "$work/rounds"
for r in $(seq "$rounds"); do
    declare -A rate=() busy=() srv=()
    for d in src m-kernel m-mount; do
        o=${d#m-}
        b0=$(busy_ticks); s0=0
        [ "$d" != src ] && s0=$(cpu_ticks "${server[$o]}")
        passes_of "$work/$d"
        b1=$(busy_ticks); s1=0
        [ "$d" != src ] && s1=$(cpu_ticks "${server[$o]}")
        rate[$d]=$(mean_got)
        busy[$d]=$(per_file $((b1 - b0)))
        srv[$d]=$(per_file $((s1 - s0)))
    done
    echo "${rate[src]} ${rate[m-kernel]} ${rate[m-mount]}" >> "$work/rounds"
    python3 -c "import sys; a = sys.argv[2:]; raw, k, m = map(float, a[0:3]); print(f'| {sys.argv[1]} | {raw:.0f} ({a[3]}) | {k/raw:.2f}× ({a[4]}, {a[5]}) | {m/raw:.2f}× ({a[6]}, {a[7]}) |')" \
        "$r" "${rate[src]}" "${rate[m-kernel]}" "${rate[m-mount]}" "${busy[src]}" \
        "${busy[m-kernel]}" "${srv[m-kernel]}" "${busy[m-mount]}" "${srv[m-mount]}"
done
python3 - "$work/rounds" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
for name, i in (("--opens kernel", 1), ("--opens mount", 2)):
    r = [row[i] / row[0] for row in rows]
    print(f"{name}: median {statistics.median(r):.2f}× raw (range {min(r):.2f}–{max(r):.2f})")
PY
