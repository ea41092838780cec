//! `objectcache-bench`: benchmark scenarios (filled in by the benchmark issues).
fn main() {
    eprintln!("objectcache-bench: no scenarios yet");
    std::process::exit(2);
}
