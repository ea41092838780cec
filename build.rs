//! build.rs: the C library's SONAME carries the C ABI version (`libobjectcache.so.N`, N from
//! `ffi/objectcache.h`'s `OBJECTCACHE_ABI_VERSION`), so a loader never pairs a program with an
//! incompatible library. The check that the header and the exports agree is
//! `crates/objectcache-capi/build.rs`, beside the exports.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=ffi/objectcache.h");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        let h = std::fs::read_to_string("ffi/objectcache.h").expect("read ffi/objectcache.h");
        let abi: u32 = h
            .lines()
            .find_map(|l| l.strip_prefix("#define OBJECTCACHE_ABI_VERSION "))
            .and_then(|v| v.trim().parse().ok())
            .expect("ffi/objectcache.h defines OBJECTCACHE_ABI_VERSION");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libobjectcache.so.{abi}");
    }
}
