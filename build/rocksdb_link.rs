// Shared by the build scripts of the crates that use RocksDB (`include!`d).
//
// RocksDB is linked statically from Debian's `librocksdb.a` (`ROCKSDB_STATIC` in
// `.cargo/config.toml`): in the shared library every access to its thread-local
// `perf_context` (several per key comparison) is a call to `__tls_get_addr`, a fifth of the
// metadata service's CPU while it stores a manifest; linked into the executable the same
// accesses are one `%fs`-relative load. `librocksdb-sys` links the archive but not what
// the archive needs, which the shared library would have pulled in by itself: those are
// named here (all come with `librocksdb-dev`).
fn link_rocksdb_dependencies() {
    println!("cargo:rerun-if-env-changed=ROCKSDB_STATIC");
    if std::env::var_os("ROCKSDB_STATIC").is_some() {
        for lib in ["snappy", "lz4", "zstd", "bz2", "z"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
    }
}
