#!/usr/bin/env bash
# How long an upgrade in place (SIGHUP to a mount's holder) stalls readers, and whether
# any read fails: one demo cluster, a version of 2,000 × 128 KiB files, a mount with no
# local node, four threads reading whole files with O_DIRECT (every read a request to
# the mount) for 4 s, SIGHUP after 1 s. Prints, per round, the reads, the worst single
# read and the failed reads.
#
#     bench/upgrade-pause.sh LOCUS [TRANSPORT] [ROUNDS]
#
# TRANSPORT is io-uring (default; the fuse module's enable_uring is switched on for the
# run and put back) or dev-fuse. Needs root (FUSE) and python3.
set -euo pipefail
. "$(dirname "$0")/demo-lib.sh"
bin=${1:?usage: $0 LOCUS [TRANSPORT] [ROUNDS]}
transport=${2:-io-uring}
rounds=${3:-3}
[ "$(id -u)" = 0 ] || { echo "needs root (FUSE)" >&2; exit 1; }
bench_work upgrade m
[ "$transport" = io-uring ] && echo Y > "$uring"

mkdir -p "$work/m"
make_files "$work/src" 2000 $((128 << 10))
start_demo "$bin" "$work/demo"
"$bin" dataset import small "$work/src" --replicas 3 > /dev/null
"$bin" mount small@1 "$work/m" --fuse-transport "$transport" > /dev/null
# The holder: the oldest process of the mount (it starts the server).
holder=$(pgrep -o -f "mount small@1 $work/m")

echo "upgrade in place under 4 O_DIRECT readers, transport $transport"
for r in $(seq "$rounds"); do
    (sleep 1; kill -HUP "$holder") &
    hup=$!
    python3 - "$work/m" 4 "$r" <<'PY'
import mmap, os, sys, threading, time
root, secs, rnd = sys.argv[1], float(sys.argv[2]), sys.argv[3]
files = sorted(os.listdir(root))
stop = time.time() + secs
results, errors = [], []
def reader(k):
    buf = mmap.mmap(-1, 1 << 20)
    i, worst, n = k * 97, 0.0, 0
    while time.time() < stop:
        t = time.perf_counter()
        try:
            fd = os.open(os.path.join(root, files[i % len(files)]), os.O_RDONLY | os.O_DIRECT)
            try:
                os.readv(fd, [buf])
            finally:
                os.close(fd)
        except OSError as e:
            errors.append(str(e))
        worst, n, i = max(worst, time.perf_counter() - t), n + 1, i + 1
    results.append((worst, n))
ts = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
for t in ts: t.start()
for t in ts: t.join()
print(f"round {rnd}: {sum(n for _, n in results)} reads, worst {max(w for w, _ in results) * 1000:.0f} ms, {len(errors)} failed {errors[:1]}")
PY
    wait "$hup"
done
