//! build.rs: checks that `ffi/objectcache.h` (the C ABI contract) and the Rust exports in
//! `src/` match, so that a mismatch fails the build.
//!
//! How: bindgen parses the header (through libclang, loaded at run time) into Rust; this
//! script reads that with `syn` and writes `$OUT_DIR/objectcache_abi_check.rs`, compiled into
//! `src` under `cfg(objectcache_abi_check)`, which asserts at compile time that
//! - every header function has a Rust export of exactly the same `extern "C"` signature
//!   (`const _: unsafe extern "C" fn(..) -> .. = crate::name;`),
//! - every header struct has the same size, alignment, field offsets and field types,
//! - every header constant has a Rust constant of the same value,
//!
//! and this script itself fails when `src` exports a `#[no_mangle]` function that the
//! header does not declare.
//!
//! libclang is needed only where the check runs (Debian/Ubuntu: `apt-get install
//! libclang-dev`). Without it the check is skipped with a warning, so a plain `cargo build`
//! works on any machine; CI sets `OBJECTCACHE_REQUIRE_ABI_CHECK=1` to make a missing libclang
//! an error. `OBJECTCACHE_SKIP_ABI_CHECK=1` skips the check.
use std::collections::BTreeSet;
use std::path::Path;

/// The C ABI contract, from this crate's folder (`crates/objectcache-capi`).
const HEADER: &str = "../../ffi/objectcache.h";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={HEADER}");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-env-changed=OBJECTCACHE_REQUIRE_ABI_CHECK");
    println!("cargo:rerun-if-env-changed=OBJECTCACHE_SKIP_ABI_CHECK");
    println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
    println!("cargo::rustc-check-cfg=cfg(objectcache_abi_check)");

    let on = |v: &str| std::env::var(v).is_ok_and(|s| !s.is_empty() && s != "0");
    if on("OBJECTCACHE_SKIP_ABI_CHECK") {
        println!("cargo:warning=C ABI check skipped (OBJECTCACHE_SKIP_ABI_CHECK is set)");
        return;
    }
    let required = on("OBJECTCACHE_REQUIRE_ABI_CHECK");
    let bindings = match generate() {
        Ok(b) => b,
        Err(why) if !required => {
            let why: String = why.chars().take(120).collect();
            println!(
                "cargo:warning=C ABI check skipped: {why} (install libclang-dev, or set \
                 LIBCLANG_PATH; set OBJECTCACHE_REQUIRE_ABI_CHECK=1 to make this an error)"
            );
            return;
        }
        Err(why) => panic!("C ABI check required (OBJECTCACHE_REQUIRE_ABI_CHECK) but {why}"),
    };
    let out =
        Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("objectcache_abi_check.rs");
    let checks = checks(&bindings);
    std::fs::write(&out, checks).expect("write the ABI check");
    println!("cargo:rustc-cfg=objectcache_abi_check");
}

/// Runs bindgen over the header; `Err` when libclang cannot be loaded or parsing fails.
fn generate() -> Result<String, String> {
    // bindgen panics when it cannot find libclang: turn that into an error.
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header(HEADER)
            .allowlist_function("objectcache_.*")
            .allowlist_type("objectcache_.*")
            .allowlist_var("OBJECTCACHE_.*")
            .layout_tests(false)
            .derive_debug(false)
            .derive_copy(false)
            .formatter(bindgen::Formatter::None)
            .generate()
            .map(|b| b.to_string())
            .map_err(|e| format!("bindgen could not parse ffi/objectcache.h: {e}"))
    });
    std::panic::set_hook(prev);
    match r {
        Ok(r) => r,
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "bindgen failed".into())
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()),
    }
}

/// Writes the compile-time assertions for the header's Rust view `bindings`.
fn checks(bindings: &str) -> String {
    use quote::{format_ident, quote};
    let file = syn::parse_file(bindings).expect("bindgen output parses");
    let mut kept = Vec::new(); // header items other than functions, re-emitted into `c`
    let mut fns = Vec::new();
    let mut structs = Vec::new();
    let mut consts = Vec::new();
    let mut type_names = BTreeSet::new();
    for item in file.items {
        match item {
            syn::Item::ForeignMod(m) => {
                for fi in m.items {
                    if let syn::ForeignItem::Fn(f) = fi {
                        fns.push(f.sig);
                    }
                }
            }
            syn::Item::Struct(s) => {
                type_names.insert(s.ident.to_string());
                structs.push(s.clone());
                kept.push(syn::Item::Struct(s));
            }
            syn::Item::Type(t) => {
                type_names.insert(t.ident.to_string());
                kept.push(syn::Item::Type(t));
            }
            syn::Item::Const(c) => {
                consts.push(c.ident.clone());
                kept.push(syn::Item::Const(c));
            }
            other => kept.push(other),
        }
    }
    // Reverse direction: every Rust export must be declared by the header.
    let header_fns: BTreeSet<String> = fns.iter().map(|s| s.ident.to_string()).collect();
    let exported = rust_exports(Path::new("src"));
    let extra: Vec<_> = exported.difference(&header_fns).cloned().collect();
    if !extra.is_empty() {
        panic!(
            "src exports functions that ffi/objectcache.h does not declare: {}",
            extra.join(", ")
        );
    }
    let ours: Vec<_> = type_names
        .iter()
        .filter(|n| n.starts_with("objectcache_"))
        .map(|n| format_ident!("{}", n))
        .collect();
    let mut out = Vec::new();
    for sig in &fns {
        let name = &sig.ident;
        let tys: Vec<_> = sig
            .inputs
            .iter()
            .map(|a| match a {
                syn::FnArg::Typed(p) => p.ty.clone(),
                syn::FnArg::Receiver(_) => unreachable!("C has no receivers"),
            })
            .collect();
        let ret = &sig.output;
        out.push(quote! {
            const _: unsafe extern "C" fn(#(#tys),*) #ret = crate::#name;
        });
    }
    for s in &structs {
        let name = &s.ident;
        let opaque = s.fields.iter().all(|f| {
            f.ident
                .as_ref()
                .is_some_and(|i| i.to_string().starts_with('_'))
                && quote!(#f).to_string().contains("0]")
        });
        let msg = format!("{name}: size or alignment differs between the header and Rust");
        out.push(quote! {
            const _: () = assert!(
                ::core::mem::size_of::<c::#name>() == ::core::mem::size_of::<crate::#name>()
                && ::core::mem::align_of::<c::#name>() == ::core::mem::align_of::<crate::#name>(),
                #msg
            );
        });
        if opaque {
            continue;
        }
        for f in &s.fields {
            let fname = f.ident.as_ref().expect("named field");
            let ty = &f.ty;
            let msg = format!("{name}.{fname}: offset differs between the header and Rust");
            let check = format_ident!("_field_{}_{}", name, fname);
            out.push(quote! {
                const _: () = assert!(
                    ::core::mem::offset_of!(c::#name, #fname)
                        == ::core::mem::offset_of!(crate::#name, #fname),
                    #msg
                );
                fn #check(s: &crate::#name) -> &#ty { &s.#fname }
            });
        }
    }
    for c in &consts {
        let msg = format!("{c}: value differs between the header and Rust");
        out.push(quote! {
            const _: () = assert!(c::#c as i64 == crate::#c as i64, #msg);
        });
    }
    let body = quote! {
        /// The header's items as bindgen sees them (functions left out).
        mod c {
            #(#kept)*
        }
        // Explicit imports (which shadow the glob) make the header's type names in the
        // signatures below mean the Rust types of `crate`.
        #[allow(unused_imports)]
        use c::*;
        #[allow(unused_imports)]
        use crate::{#(#ours),*};
        #(#out)*
    };
    format!("// @generated by build.rs from ffi/objectcache.h\n{body}\n")
}

/// Names of `#[no_mangle]` functions defined in the Rust files under `dir`.
fn rust_exports(dir: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read src").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).expect("read a source file");
                let file = syn::parse_file(&text).expect("src parses");
                for item in file.items {
                    if let syn::Item::Fn(f) = item {
                        let no_mangle = f.attrs.iter().any(|a| {
                            let s = quote::quote!(#a).to_string();
                            s.contains("no_mangle")
                        });
                        if no_mangle {
                            names.insert(f.sig.ident.to_string());
                        }
                    }
                }
            }
        }
    }
    names
}
