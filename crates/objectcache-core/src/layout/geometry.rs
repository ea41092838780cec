//! KV geometry: how many bytes one token's K and V occupy per layer, and model presets.
#![forbid(unsafe_code)]

use crate::error::Error;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::str::FromStr;

/// Element type of the cached K and V tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dtype {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    Fp16,
    /// 8-bit float E4M3 (as used by vLLM's fp8 KV cache), 1 byte.
    Fp8E4m3,
    /// IEEE single, 4 bytes.
    Fp32,
}

impl Dtype {
    /// Size of one element in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp8E4m3 => 1,
            Dtype::Fp32 => 4,
        }
    }
    /// Stable numeric code used in the object header (see docs/object-format.md).
    pub fn code(self) -> u8 {
        match self {
            Dtype::Bf16 => 1,
            Dtype::Fp16 => 2,
            Dtype::Fp8E4m3 => 3,
            Dtype::Fp32 => 4,
        }
    }
    /// Inverse of [`Dtype::code`]; `None` for an unknown code.
    pub fn from_code(c: u8) -> Option<Dtype> {
        Some(match c {
            1 => Dtype::Bf16,
            2 => Dtype::Fp16,
            3 => Dtype::Fp8E4m3,
            4 => Dtype::Fp32,
            _ => return None,
        })
    }
    /// The canonical name (`bf16`, `fp16`, `fp8-e4m3`, `fp32`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8E4m3 => "fp8-e4m3",
            Dtype::Fp32 => "fp32",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = Error;
    /// Parses `bf16`, `fp16`/`f16`, `fp8-e4m3`/`fp8`, `fp32`/`f32`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the unknown dtype.
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp16" | "f16" | "float16" | "half" => Dtype::Fp16,
            "fp8-e4m3" | "fp8_e4m3" | "fp8" | "e4m3" => Dtype::Fp8E4m3,
            "fp32" | "f32" | "float32" | "float" => Dtype::Fp32,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown dtype {other:?}: expected bf16, fp16, fp8-e4m3 or fp32"
                )))
            }
        })
    }
}

/// Default tokens per chunk (the engine's block size as seen by ObjectCache).
pub const DEFAULT_TOKENS_PER_CHUNK: u32 = 256;

/// Longest [`KvLayout::name`] in bytes.
pub const MAX_LAYOUT_NAME: usize = 64;

/// An inference engine's own memory layout of KV blocks, named in the key.
///
/// With a layout, a chunk object's layer slice holds that layer's engine blocks for the
/// chunk's tokens (`tokens_per_chunk / block_size` blocks, in token order), each stored byte
/// for byte as the engine keeps it in memory: no conversion on save or load. The layout is
/// part of the [geometry fingerprint](KvGeometry::fingerprint), so an engine whose layout
/// differs (another family, another block size), even at the same byte size, gets misses and
/// never bytes of another meaning. Without a layout ([`KvGeometry::layout`] `None`) a slice
/// is ObjectCache's canonical layout: K then V, each `[tokens, kv_heads / tp_world, head_dim]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// The engine and its layout family, e.g. `vllm/cpu_attn` (vLLM's CPU attention backend:
    /// per layer `[num_blocks, kv_heads, block_size, 2 x head_dim]`). 1 to
    /// [`MAX_LAYOUT_NAME`] bytes of `[A-Za-z0-9._:/+-]`. Include a version when the engine may
    /// change the meaning of its blocks under the same name.
    pub name: String,
    /// Tokens per engine block; divides `tokens_per_chunk` (a chunk is a whole number of
    /// engine blocks).
    pub block_size: u32,
}

impl KvLayout {
    /// Checks the name's characters and length and that `block_size` is nonzero.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        let n = &self.name;
        if n.is_empty() || n.len() > MAX_LAYOUT_NAME {
            return Err(Error::InvalidArgument(format!(
                "geometry: layout name {n:?} must be 1 to {MAX_LAYOUT_NAME} bytes"
            )));
        }
        if !n
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._:/+-".contains(&c))
        {
            return Err(Error::InvalidArgument(format!(
                "geometry: layout name {n:?} may hold only letters, digits and . _ : / + -"
            )));
        }
        if self.block_size == 0 {
            return Err(Error::InvalidArgument(format!(
                "geometry: layout {n:?} has block_size 0"
            )));
        }
        Ok(())
    }
}

/// The shape of one model's KV cache as one TP rank stores it.
///
/// A chunk of `tokens_per_chunk` tokens holds, for every layer, K and V tensors of shape
/// `[tokens, kv_heads / tp_world, head_dim]` in `dtype`. KV heads are split evenly across TP
/// ranks (vLLM/SGLang tensor parallelism), so `kv_heads` must be divisible by `tp_world`.
///
/// `model` is the model's identifier (e.g. `meta-llama/Llama-3.1-8B`); it enters the
/// [fingerprint](KvGeometry::fingerprint) so that two models of equal shape never share keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGeometry {
    /// Model identifier, part of the fingerprint.
    pub model: String,
    /// Number of transformer layers (attention blocks).
    pub layers: u32,
    /// KV heads of the whole model (before the TP split).
    pub kv_heads: u32,
    /// Head dimension (elements).
    pub head_dim: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per chunk object (default 256).
    pub tokens_per_chunk: u32,
    /// This process's tensor-parallel rank, `0..tp_world`.
    pub tp_rank: u32,
    /// Tensor-parallel world size (1 without TP).
    pub tp_world: u32,
    /// The engine's own block layout, if the slices hold the engine's bytes as they are
    /// (`None`: ObjectCache's canonical K-then-V layout). Part of the fingerprint.
    #[serde(default)]
    pub layout: Option<KvLayout>,
}

impl KvGeometry {
    /// Builds and validates a geometry for TP world 1, 256 tokens per chunk.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] as for [`KvGeometry::validate`].
    pub fn new(
        model: &str,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
    ) -> Result<Self, Error> {
        let g = KvGeometry {
            model: model.to_string(),
            layers,
            kv_heads,
            head_dim,
            dtype,
            tokens_per_chunk: DEFAULT_TOKENS_PER_CHUNK,
            tp_rank: 0,
            tp_world: 1,
            layout: None,
        };
        g.validate()?;
        Ok(g)
    }

    /// Checks every field: nonzero sizes, `tp_rank < tp_world`, `kv_heads % tp_world == 0`,
    /// at most 1,024 layers, a chunk-layer slice of at most 1 GiB, and a layout (if any) with
    /// a valid name and a block size dividing `tokens_per_chunk`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first field that is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.model.is_empty() {
            return bad("geometry: model name is empty".into());
        }
        if self.layers == 0 {
            return bad("geometry: layers must be at least 1 (got 0)".into());
        }
        if self.layers > 1024 {
            return bad(format!(
                "geometry: {} layers is more than the supported 1024",
                self.layers
            ));
        }
        if self.kv_heads == 0 || self.head_dim == 0 {
            return bad(format!(
                "geometry: kv_heads ({}) and head_dim ({}) must be nonzero",
                self.kv_heads, self.head_dim
            ));
        }
        if self.tokens_per_chunk == 0 {
            return bad("geometry: tokens_per_chunk must be at least 1".into());
        }
        if self.tp_world == 0 || self.tp_rank >= self.tp_world {
            return bad(format!(
                "geometry: tp_rank {} is not below tp_world {}",
                self.tp_rank, self.tp_world
            ));
        }
        if !self.kv_heads.is_multiple_of(self.tp_world) {
            return bad(format!(
                "geometry: {} KV heads cannot be split evenly over TP world {}",
                self.kv_heads, self.tp_world
            ));
        }
        if self.slice_bytes() > (1 << 30) {
            return bad(format!(
                "geometry: one chunk-layer slice would be {} bytes, above the 1 GiB limit",
                self.slice_bytes()
            ));
        }
        if let Some(l) = &self.layout {
            l.validate()?;
            if !self.tokens_per_chunk.is_multiple_of(l.block_size) {
                return bad(format!(
                    "geometry: layout {:?} has {}-token blocks, which do not divide \
                     tokens_per_chunk {} (a chunk is a whole number of engine blocks)",
                    l.name, l.block_size, self.tokens_per_chunk
                ));
            }
        }
        Ok(())
    }

    /// KV heads held by one TP rank.
    pub fn kv_heads_per_rank(&self) -> u32 {
        self.kv_heads / self.tp_world.max(1)
    }

    /// Bytes of K plus V for one token in one layer on this rank:
    /// `2 x kv_heads/tp_world x head_dim x dtype bytes` (4,096 for Llama-3.1-8B in bf16).
    pub fn bytes_per_token_per_layer(&self) -> u64 {
        2 * self.kv_heads_per_rank() as u64 * self.head_dim as u64 * self.dtype.bytes() as u64
    }

    /// Bytes of one chunk's slice of one layer (K then V), without its checksum:
    /// `tokens_per_chunk x bytes_per_token_per_layer` (1 MiB for Llama-3.1-8B, 256 tokens).
    pub fn slice_bytes(&self) -> u64 {
        self.tokens_per_chunk as u64 * self.bytes_per_token_per_layer()
    }

    /// Bytes of K (or of V) alone in one chunk-layer slice.
    pub fn half_slice_bytes(&self) -> u64 {
        self.slice_bytes() / 2
    }

    /// KV bytes of `tokens` tokens over all layers on this rank.
    pub fn bytes_for_tokens(&self, tokens: u64) -> u64 {
        tokens * self.bytes_per_token_per_layer() * self.layers as u64
    }

    /// Returns a copy with another TP rank (same world).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `rank >= tp_world`.
    pub fn with_rank(&self, rank: u32) -> Result<Self, Error> {
        let mut g = self.clone();
        g.tp_rank = rank;
        g.validate()?;
        Ok(g)
    }

    /// Returns a copy whose slices hold the engine's own layout `name` with `block_size`-token
    /// blocks (see [`KvLayout`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad name, or a block size that does not divide
    /// `tokens_per_chunk`.
    pub fn with_layout(&self, name: &str, block_size: u32) -> Result<Self, Error> {
        let g = KvGeometry {
            layout: Some(KvLayout {
                name: name.to_string(),
                block_size,
            }),
            ..self.clone()
        };
        g.validate()?;
        Ok(g)
    }

    /// Returns a copy with another dtype.
    pub fn with_dtype(&self, dtype: Dtype) -> Self {
        KvGeometry {
            dtype,
            ..self.clone()
        }
    }

    /// Returns a copy with another chunk size in tokens.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `tokens` is 0 or the slice would exceed 1 GiB.
    pub fn with_tokens_per_chunk(&self, tokens: u32) -> Result<Self, Error> {
        let g = KvGeometry {
            tokens_per_chunk: tokens,
            ..self.clone()
        };
        g.validate()?;
        Ok(g)
    }

    /// 64-bit model fingerprint: the first 8 bytes (big-endian) of SHA-256 over
    /// `"objectcache-geometry-v1|model|layers|kv_heads|head_dim|dtype|tokens_per_chunk|tp_world"`,
    /// followed, when a [`KvLayout`] is named, by `"|layout={name}|block={block_size}"`.
    ///
    /// It excludes `tp_rank` (the rank is a separate key component) and includes everything
    /// else that changes the bytes or their meaning, so objects of two models or layouts
    /// never collide. A geometry without a layout has the fingerprint it always had. The
    /// string is unambiguous: a layout name holds no `|`, and the last field tells whether a
    /// layout follows (`block=N`, never a bare number).
    pub fn fingerprint(&self) -> u64 {
        let mut s = format!(
            "objectcache-geometry-v1|{}|{}|{}|{}|{}|{}|{}",
            self.model,
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype.name(),
            self.tokens_per_chunk,
            self.tp_world
        );
        if let Some(l) = &self.layout {
            s.push_str(&format!("|layout={}|block={}", l.name, l.block_size));
        }
        let d = Sha256::digest(s.as_bytes());
        u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
    }

    /// Looks up a preset by name (case-insensitive): `llama-3.1-8b`, `llama-3.1-70b`
    /// (TP 1), `llama-3.1-70b-tp8` (rank 0 of 8), `qwen2.5-7b`, `smollm2-135m`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] listing the known presets.
    pub fn preset(name: &str) -> Result<Self, Error> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "llama-3.1-8b" | "llama3.1-8b" | "8b" => Self::llama31_8b(),
            "llama-3.1-70b" | "llama3.1-70b" | "70b" => Self::llama31_70b(1, 0)?,
            "llama-3.1-70b-tp8" | "70b-tp8" => Self::llama31_70b(8, 0)?,
            "qwen2.5-7b" | "qwen2.5-7b-instruct" => Self::qwen25_7b(),
            "smollm2-135m" | "smollm2-135m-instruct" => Self::smollm2_135m(),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown model preset {other:?}: known presets are {}",
                    PRESET_NAMES.join(", ")
                )))
            }
        })
    }

    /// A bf16 model at TP 1 with ObjectCache's canonical layout and default chunk size:
    /// `layers` layers of `kv_heads` KV heads of `head_dim` elements (the presets below).
    fn bf16(model: &str, layers: u32, kv_heads: u32, head_dim: u32) -> Self {
        KvGeometry {
            model: model.into(),
            layers,
            kv_heads,
            head_dim,
            dtype: Dtype::Bf16,
            tokens_per_chunk: DEFAULT_TOKENS_PER_CHUNK,
            tp_rank: 0,
            tp_world: 1,
            layout: None,
        }
    }

    /// Llama-3.1-8B in bf16: 32 layers, 8 KV heads, head dim 128 (4,096 bytes per token per
    /// layer). Source: `config.json` of meta-llama/Llama-3.1-8B on Hugging Face
    /// (`num_hidden_layers: 32`, `num_key_value_heads: 8`, `hidden_size: 4096`,
    /// `num_attention_heads: 32`, `torch_dtype: bfloat16`); Llama 3 paper Table 3.
    pub fn llama31_8b() -> Self {
        Self::bf16("meta-llama/Llama-3.1-8B", 32, 8, 128)
    }

    /// Llama-3.1-70B in bf16: 80 layers, 8 KV heads, head dim 128; at TP 8 each rank holds one
    /// KV head (512 bytes per token per layer). Source: `config.json` of
    /// meta-llama/Llama-3.1-70B (`num_hidden_layers: 80`, `num_key_value_heads: 8`,
    /// `hidden_size: 8192`, `num_attention_heads: 64`); Llama 3 paper Table 3.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `tp_world` does not divide 8 or `rank >= tp_world`.
    pub fn llama31_70b(tp_world: u32, rank: u32) -> Result<Self, Error> {
        let g = KvGeometry {
            tp_rank: rank,
            tp_world,
            ..Self::bf16("meta-llama/Llama-3.1-70B", 80, 8, 128)
        };
        g.validate()?;
        Ok(g)
    }

    /// Qwen2.5-7B in bf16: 28 layers, 4 KV heads, head dim 128 (3584 / 28 query heads).
    /// Source: `config.json` of Qwen/Qwen2.5-7B (`num_hidden_layers: 28`,
    /// `num_key_value_heads: 4`, `hidden_size: 3584`, `num_attention_heads: 28`).
    pub fn qwen25_7b() -> Self {
        Self::bf16("Qwen/Qwen2.5-7B", 28, 4, 128)
    }

    /// SmolLM2-135M in bf16: 30 layers, 3 KV heads, head dim 64 (576 / 9 query heads).
    /// Source: `config.json` of HuggingFaceTB/SmolLM2-135M (`num_hidden_layers: 30`,
    /// `num_key_value_heads: 3`, `hidden_size: 576`, `num_attention_heads: 9`); the same
    /// values are in the GGUF metadata of SmolLM2-135M-Instruct.
    pub fn smollm2_135m() -> Self {
        Self::bf16("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64)
    }
}

/// Names accepted by [`KvGeometry::preset`].
pub const PRESET_NAMES: &[&str] = &[
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-70b-tp8",
    "qwen2.5-7b",
    "smollm2-135m",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_published_configs() {
        let g = KvGeometry::llama31_8b();
        assert_eq!(g.bytes_per_token_per_layer(), 4096);
        assert_eq!(g.slice_bytes(), 1 << 20);
        assert_eq!(g.bytes_for_tokens(4096), 512 << 20);
        let g = KvGeometry::llama31_70b(8, 3).unwrap();
        assert_eq!(g.bytes_per_token_per_layer(), 512);
        assert_eq!(g.layers, 80);
        assert_eq!(KvGeometry::smollm2_135m().bytes_per_token_per_layer(), 768);
        assert_eq!(KvGeometry::qwen25_7b().bytes_per_token_per_layer(), 2048);
    }

    #[test]
    fn fingerprints_separate_models_and_layouts() {
        let a = KvGeometry::llama31_8b();
        let b = KvGeometry::smollm2_135m();
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), a.with_dtype(Dtype::Fp16).fingerprint());
        assert_ne!(
            a.fingerprint(),
            a.with_tokens_per_chunk(16).unwrap().fingerprint()
        );
        let r0 = KvGeometry::llama31_70b(8, 0).unwrap();
        assert_eq!(r0.fingerprint(), r0.with_rank(7).unwrap().fingerprint());
    }

    #[test]
    fn geometries_without_a_layout_keep_their_fingerprints() {
        // Pinned values, computed before layouts existed: adding the layout must not move the
        // keys of anything already stored.
        assert_eq!(KvGeometry::llama31_8b().fingerprint(), 0xda38789902d7d96c);
        assert_eq!(KvGeometry::smollm2_135m().fingerprint(), 0x5c3890271771a5c2);
    }

    #[test]
    fn layouts_of_equal_byte_size_have_distinct_fingerprints() {
        let g = KvGeometry::smollm2_135m();
        let cpu = g.with_layout("vllm/cpu_attn", 128).unwrap();
        let cpu16 = g.with_layout("vllm/cpu_attn", 16).unwrap();
        let flash = g.with_layout("vllm/flash_attn", 128).unwrap();
        // Every one holds the same bytes per slice; the meaning differs.
        for x in [&cpu, &cpu16, &flash] {
            assert_eq!(x.slice_bytes(), g.slice_bytes());
        }
        let fps = [
            g.fingerprint(),
            cpu.fingerprint(),
            cpu16.fingerprint(),
            flash.fingerprint(),
        ];
        for i in 0..fps.len() {
            for j in i + 1..fps.len() {
                assert_ne!(fps[i], fps[j], "geometries {i} and {j} share a fingerprint");
            }
        }
        // The rank stays out of the fingerprint with a layout too.
        let r = KvGeometry::llama31_70b(8, 0)
            .unwrap()
            .with_layout("vllm/cpu_attn", 16)
            .unwrap();
        assert_eq!(r.fingerprint(), r.with_rank(5).unwrap().fingerprint());
    }

    #[test]
    fn bad_layouts_are_named() {
        let g = KvGeometry::smollm2_135m();
        for (name, bs, needle) in [
            ("", 16, "1 to 64 bytes"),
            ("a|b", 16, "may hold only"),
            ("vllm cpu", 16, "may hold only"),
            ("vllm", 0, "block_size 0"),
            ("vllm", 96, "do not divide tokens_per_chunk 256"),
        ] {
            let e = g.with_layout(name, bs).unwrap_err().to_string();
            assert!(e.contains(needle), "{name:?}/{bs}: {e}");
        }
        assert!(g.with_layout(&"x".repeat(65), 16).is_err());
        assert!(g.with_layout("vLLM-0.32/cpu_attn:LBHNC+v1.x", 256).is_ok());
    }

    #[test]
    fn bad_geometry_is_named() {
        let mut g = KvGeometry::llama31_8b();
        g.layers = 0;
        assert!(g.validate().unwrap_err().to_string().contains("layers"));
        assert!(KvGeometry::llama31_70b(3, 0)
            .unwrap_err()
            .to_string()
            .contains("split evenly"));
        assert!("int4"
            .parse::<Dtype>()
            .unwrap_err()
            .to_string()
            .contains("int4"));
        assert!(KvGeometry::preset("gpt-5")
            .unwrap_err()
            .to_string()
            .contains("llama-3.1-8b"));
    }
}
