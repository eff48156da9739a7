# Shared by the bench scripts that run against a demo cluster; sourced, not run.
#
#   make_files DIR COUNT BYTES    COUNT files of BYTES random bytes (f00000.bin, ...)
#   start_demo LOCUS DIR          a demo cluster kept running in DIR: sets demo_pid and
#                                 exports LOCUS_METADATA (stop it with kill "$demo_pid")
#   bench_work NAME MOUNT...      a fresh work directory /var/tmp/locus-NAME.* (sets work),
#                                 removed at exit after each WORK/MOUNT is unmounted, the
#                                 demo cluster (if any) stopped and the fuse module's
#                                 enable_uring put back as it was
#   mount_builds OLD NEW TARGET WORK [ARGS...]
#                                 TARGET mounted with each build on the demo's node1, at
#                                 WORK/m-old and WORK/m-new (returns once both serve)

make_files() {
    mkdir -p "$1"
    python3 - "$1" "$2" "$3" <<'PY'
import os, sys
for i in range(int(sys.argv[2])):
    with open(f"{sys.argv[1]}/f{i:05d}.bin", "wb") as f:
        f.write(os.urandom(int(sys.argv[3])))
PY
}

start_demo() {
    "$1" demo --keep-running --dir "$2" > "$2.log" 2>&1 &
    demo_pid=$!
    for _ in $(seq 60); do
        grep -q "export LOCUS_METADATA=" "$2.log" && break
        sleep 1
    done
    LOCUS_METADATA=$(grep -o "export LOCUS_METADATA=[^ ]*" "$2.log" | head -1 | cut -d= -f2)
    [ -n "$LOCUS_METADATA" ] || { echo "the demo cluster did not start: $2.log" >&2; exit 1; }
    export LOCUS_METADATA
}

mount_builds() {
    local old=$1 new=$2 target=$3 work=$4 b bin
    shift 4
    for b in old new; do
        bin=$old; [ $b = new ] && bin=$new
        mkdir -p "$work/m-$b"
        "$bin" mount "$target" "$work/m-$b" --node-socket "$work/demo/node1.sock" "$@" > /dev/null
    done
}

bench_work() {
    work=$(mktemp -d "/var/tmp/locus-$1.XXXXXX")
    shift
    bench_mounts=("$@")
    uring=/sys/module/fuse/parameters/enable_uring
    uring_was=$(cat "$uring" 2>/dev/null || echo N)
    demo_pid=
    trap bench_cleanup EXIT
}

bench_cleanup() {
    local m
    for m in "${bench_mounts[@]}"; do fusermount3 -u "$work/$m" 2>/dev/null || true; done
    [ -n "$demo_pid" ] && kill "$demo_pid" 2>/dev/null || true
    [ -w "$uring" ] && echo "$uring_was" > "$uring"
    rm -rf "$work"
}
