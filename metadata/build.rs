include!("../build/rocksdb_link.rs");

fn main() {
    link_rocksdb_dependencies();
}
