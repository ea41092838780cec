//! The `objectcache` command-line tool. All logic lives in the library's `cli` module.
fn main() {
    eprintln!("objectcache: no subcommands yet");
    std::process::exit(2);
}
