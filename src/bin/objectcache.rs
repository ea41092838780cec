//! The `objectcache` command-line tool. All logic lives in the library's `cli` module.
fn main() {
    std::process::exit(objectcache::cli::main());
}
