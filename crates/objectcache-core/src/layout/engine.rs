//! [`EngineLayout`]: an inference engine's KV cache layout as a typed value — what one block
//! of one layer holds (the family and its dimensions), the block size and dtype, and the KV
//! cache group the layer belongs to — from which the layout name in the keys, the bytes of a
//! block and the geometry follow. Engines (the vLLM connector) describe their blocks with it
//! instead of composing names themselves; the C ABI's `objectcache_engine_layout_resolve`
//! is this module.
//!
//! The names are those the connector composed before this type existed, so the keys of
//! existing entries stay valid: `{engine}/{order}` for one group of paged K/V (for example
//! `vllm0.32/cpu-amx/LBHNC`), `/mla{latent}` after it for one MLA group, and
//! `/g{i}of{n}-{kind}{window}-{structure}` after it for each group of a model with several
//! (`kind` = `full`, `swa`, `mla`).

use super::geometry::{Dtype, KvGeometry, KvLayout, MAX_LAYOUT_NAME};
use crate::error::Error;

/// What one block of one layer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutFamily {
    /// K and V of `kv_heads` heads of `head_dim` elements for each of the block's tokens,
    /// packed as the engine packs them (separate or fused tensors, NHD or HND order, a CPU
    /// kernel's packing): `2 x kv_heads x head_dim` elements per token. `order` is the
    /// engine's own name for its packing (vLLM's KV cache layout: `NHD`, `HND`, `LBHNC`).
    PagedKv {
        /// The engine's name for its block packing.
        order: String,
        /// KV heads on this TP rank.
        kv_heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// Multi-head latent attention (DeepSeek V2/V3, Kimi K2): one latent vector of
    /// `latent_dim` elements per token (the compressed KV and the rotary key together; no
    /// separate V), the same on every TP rank, so stored once for all ranks.
    MlaLatent {
        /// The engine's name for its block packing.
        order: String,
        /// Elements per token (576 for DeepSeek V2/V3: 512 + 64).
        latent_dim: u32,
    },
    /// Recurrent state (Mamba, linear attention): a state per sequence, not KV per token.
    /// Not supported: a prefix loaded without its state would give wrong output.
    Recurrent,
    /// A layout ObjectCache does not know, named verbatim, with the bytes per token it holds
    /// (the engine vouches for them).
    Opaque {
        /// The name used in the keys after the engine's name.
        name: String,
        /// Bytes per token per layer.
        bytes_per_token: u64,
    },
}

/// The kind of KV cache group a layer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention: every token of the prefix is read.
    Full,
    /// Sliding window: only the last `window` tokens are read.
    SlidingWindow {
        /// Tokens.
        window: u32,
    },
}

/// The layer's KV cache group, when the model has more than one (vLLM's hybrid KV cache
/// manager): each group has its own block table and its own chunk objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutGroup {
    /// This group's index, `0..count`.
    pub index: u32,
    /// Groups of the model (at least 2).
    pub count: u32,
    /// The group's kind.
    pub kind: GroupKind,
    /// A digest of the model's group structure (each group's kind, window and layers; the
    /// engine computes it), so that a change of window or layer pattern is a miss: 1 to 16
    /// hex digits.
    pub structure: String,
}

/// An engine's KV cache layout for one group of layers (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineLayout {
    /// The engine, its version and device, e.g. `vllm0.32/cpu-amx` or `vllm0.32/cuda`
    /// (`[A-Za-z0-9._:/+-]`; a version, because an engine may change what its blocks mean).
    pub engine: String,
    /// What a block holds.
    pub family: LayoutFamily,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type.
    pub dtype: Dtype,
    /// The group, for models with several (`None`: one group).
    pub group: Option<LayoutGroup>,
}

/// What an [`EngineLayout`] gives: the name in the keys, the bytes of one block of one layer,
/// and the geometry's dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLayout {
    /// The layout name in the keys ([`KvLayout::name`]).
    pub name: String,
    /// Bytes of one block of one layer: `block_size x bytes per token`.
    pub block_bytes: u64,
    /// The geometry's KV heads (of the whole model, before the TP split).
    pub kv_heads: u32,
    /// The geometry's head dimension (elements).
    pub head_dim: u32,
    /// Whether every TP rank holds the same bytes (MLA): one object per chunk for all ranks,
    /// the geometry at rank 0 of a world of 1.
    pub stored_once: bool,
}

impl EngineLayout {
    /// The name, block bytes and geometry dimensions for a TP world of `tp_world` ranks.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for [`LayoutFamily::Recurrent`]; [`Error::InvalidArgument`]
    /// naming the field for a name with other characters or over [`MAX_LAYOUT_NAME`] bytes,
    /// a zero dimension or block size, an odd MLA latent (the geometry's K-and-V form holds
    /// `2 x head_dim` elements per token), an opaque layout whose bytes per token are not
    /// whole elements, or a group index out of range.
    pub fn resolve(&self, tp_world: u32) -> Result<ResolvedLayout, Error> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("engine layout: {what}")));
        if self.block_size == 0 {
            return bad("block_size 0".into());
        }
        if tp_world == 0 {
            return bad("tp_world 0".into());
        }
        let dt = u64::from(self.dtype.bytes());
        let (order, per_token, kv_heads, head_dim, stored_once, kind) = match &self.family {
            LayoutFamily::PagedKv {
                order,
                kv_heads,
                head_dim,
            } => {
                if *kv_heads == 0 || *head_dim == 0 {
                    return bad(format!("kv_heads {kv_heads}, head_dim {head_dim}"));
                }
                let per = 2 * u64::from(*kv_heads) * u64::from(*head_dim) * dt;
                let heads = kv_heads.checked_mul(tp_world).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "engine layout: {kv_heads} heads x {tp_world} ranks"
                    ))
                })?;
                (order.as_str(), per, heads, *head_dim, false, None)
            }
            LayoutFamily::MlaLatent { order, latent_dim } => {
                if *latent_dim == 0 || latent_dim % 2 != 0 {
                    return bad(format!(
                        "MLA latent of {latent_dim} elements (must be even and nonzero)"
                    ));
                }
                let per = u64::from(*latent_dim) * dt;
                (order.as_str(), per, 1, latent_dim / 2, true, Some("mla"))
            }
            LayoutFamily::Recurrent => {
                return Err(Error::Unsupported(
                    "engine layout: recurrent state (Mamba, linear attention) is not stored; \
                     supported: paged K/V (full attention, sliding window) and MLA"
                        .into(),
                ))
            }
            LayoutFamily::Opaque {
                name,
                bytes_per_token,
            } => {
                let elems = 2 * dt;
                if *bytes_per_token == 0 || bytes_per_token % elems != 0 {
                    return bad(format!(
                        "opaque layout {name:?}: {bytes_per_token} bytes per token is not a \
                         whole number of K-and-V element pairs of {dt} bytes"
                    ));
                }
                let d = u32::try_from(bytes_per_token / elems).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "engine layout: {bytes_per_token} bytes per token"
                    ))
                })?;
                (name.as_str(), *bytes_per_token, 1, d, false, None)
            }
        };
        let mut name = format!("{}/{}", self.engine, order);
        match (&self.group, kind) {
            (None, Some(k)) => name.push_str(&format!("/{k}{}", per_token / dt)),
            (None, None) => {}
            (Some(g), _) => {
                if g.count < 2 || g.index >= g.count {
                    return bad(format!("group {} of {}", g.index, g.count));
                }
                let (k, w) = match (kind, g.kind) {
                    (Some(k), _) => (k, 0),
                    (None, GroupKind::Full) => ("full", 0),
                    (None, GroupKind::SlidingWindow { window }) => ("swa", window),
                };
                if g.structure.is_empty()
                    || g.structure.len() > 16
                    || !g.structure.bytes().all(|c| c.is_ascii_hexdigit())
                {
                    return bad(format!(
                        "group structure {:?} must be 1 to 16 hex digits",
                        g.structure
                    ));
                }
                let w = if w == 0 { String::new() } else { w.to_string() };
                name.push_str(&format!(
                    "/g{}of{}-{k}{w}-{}",
                    g.index, g.count, g.structure
                ));
            }
        }
        if name.len() > MAX_LAYOUT_NAME {
            return bad(format!(
                "name {name:?} is over {MAX_LAYOUT_NAME} bytes (shorten the engine's name)"
            ));
        }
        KvLayout {
            name: name.clone(),
            block_size: self.block_size,
        }
        .validate()?;
        Ok(ResolvedLayout {
            name,
            block_bytes: u64::from(self.block_size) * per_token,
            kv_heads,
            head_dim,
            stored_once,
        })
    }

    /// The geometry of this layout's layers: `layers` layers of model `model`,
    /// `tokens_per_chunk` tokens a chunk, as TP rank `tp_rank` of `tp_world` stores it (rank 0
    /// of 1 when [`ResolvedLayout::stored_once`]).
    ///
    /// # Errors
    /// As [`EngineLayout::resolve`], and [`KvGeometry::validate`]'s.
    pub fn geometry(
        &self,
        model: &str,
        layers: u32,
        tokens_per_chunk: u32,
        tp_rank: u32,
        tp_world: u32,
    ) -> Result<KvGeometry, Error> {
        let r = self.resolve(tp_world)?;
        let (rank, world) = if r.stored_once {
            (0, 1)
        } else {
            (tp_rank, tp_world)
        };
        let mut g = KvGeometry::new(model, layers, r.kv_heads, r.head_dim, self.dtype)?;
        g.tokens_per_chunk = tokens_per_chunk;
        g.tp_rank = rank;
        g.tp_world = world;
        g.layout = Some(KvLayout {
            name: r.name,
            block_size: self.block_size,
        });
        g.validate()?;
        Ok(g)
    }

    /// Checks that one block of one layer of the engine's memory is `got` bytes, as this
    /// layout says.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming both sizes and the dimensions behind the expected
    /// one, or the layout's own error.
    pub fn check_block_bytes(&self, got: u64) -> Result<(), Error> {
        let r = self.resolve(1)?;
        if got == r.block_bytes {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "engine layout {}: one block of one layer is {got} bytes in the engine's memory, \
             but {:?} of {} tokens in {:?} gives {} bytes",
            r.name, self.family, self.block_size, self.dtype, r.block_bytes
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paged(order: &str, heads: u32, dim: u32) -> LayoutFamily {
        LayoutFamily::PagedKv {
            order: order.into(),
            kv_heads: heads,
            head_dim: dim,
        }
    }

    fn layout(family: LayoutFamily, group: Option<LayoutGroup>) -> EngineLayout {
        EngineLayout {
            engine: "vllm0.32/cpu-amx".into(),
            family,
            block_size: 128,
            dtype: Dtype::Bf16,
            group,
        }
    }

    /// The names the vLLM connector composed before this type: existing keys stay valid.
    #[test]
    fn names_are_the_connectors_names_of_before() {
        let one = layout(paged("LBHNC", 3, 64), None).resolve(1).unwrap();
        assert_eq!(one.name, "vllm0.32/cpu-amx/LBHNC");
        assert_eq!(
            (one.kv_heads, one.head_dim, one.stored_once),
            (3, 64, false)
        );
        // SmolLM2's block: 2 x 128 tokens x 3 heads x 64 x 2 bytes = 96 KiB.
        assert_eq!(one.block_bytes, 96 * 1024);
        let mla = LayoutFamily::MlaLatent {
            order: "LBHNC".into(),
            latent_dim: 576,
        };
        let m = layout(mla.clone(), None).resolve(2).unwrap();
        assert_eq!(m.name, "vllm0.32/cpu-amx/LBHNC/mla576");
        assert_eq!((m.kv_heads, m.head_dim, m.stored_once), (1, 288, true));
        assert_eq!(m.block_bytes, 128 * 576 * 2);
        let g = |i, kind| {
            Some(LayoutGroup {
                index: i,
                count: 6,
                kind,
                structure: "1a2b3c4d".into(),
            })
        };
        let swa = layout(
            paged("LBHNC", 2, 64),
            g(0, GroupKind::SlidingWindow { window: 512 }),
        );
        assert_eq!(
            swa.resolve(1).unwrap().name,
            "vllm0.32/cpu-amx/LBHNC/g0of6-swa512-1a2b3c4d"
        );
        let full = layout(paged("LBHNC", 2, 64), g(5, GroupKind::Full));
        assert_eq!(
            full.resolve(1).unwrap().name,
            "vllm0.32/cpu-amx/LBHNC/g5of6-full-1a2b3c4d"
        );
        let mla_group = layout(mla, g(1, GroupKind::Full));
        assert_eq!(
            mla_group.resolve(1).unwrap().name,
            "vllm0.32/cpu-amx/LBHNC/g1of6-mla-1a2b3c4d"
        );
    }

    /// Different kinds, windows and group structures give different fingerprints: a chunk of
    /// one never answers for another.
    #[test]
    fn groups_of_other_kinds_windows_or_structures_never_share_keys() {
        let g = |kind, structure: &str| {
            layout(
                paged("LBHNC", 2, 64),
                Some(LayoutGroup {
                    index: 0,
                    count: 2,
                    kind,
                    structure: structure.into(),
                }),
            )
            .geometry("m", 4, 128, 0, 1)
            .unwrap()
            .fingerprint()
        };
        let a = g(GroupKind::Full, "aa");
        let b = g(GroupKind::SlidingWindow { window: 512 }, "aa");
        let c = g(GroupKind::SlidingWindow { window: 1024 }, "aa");
        let d = g(GroupKind::SlidingWindow { window: 512 }, "bb");
        let all = [a, b, c, d];
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "{i} and {j}");
            }
        }
    }

    #[test]
    fn geometry_of_mla_is_rank_0_of_1_whatever_the_tp_size() {
        let l = layout(
            LayoutFamily::MlaLatent {
                order: "NHD".into(),
                latent_dim: 576,
            },
            None,
        );
        for (rank, world) in [(0, 1), (1, 2), (7, 8)] {
            let g = l.geometry("deepseek", 4, 128, rank, world).unwrap();
            assert_eq!((g.tp_rank, g.tp_world), (0, 1));
            // 576 bf16 elements per token per layer, as the engine's block holds them.
            assert_eq!(g.slice_bytes(), 128 * 576 * 2);
        }
        let p = layout(paged("NHD", 4, 128), None);
        let g = p.geometry("llama", 4, 256, 1, 2).unwrap();
        assert_eq!((g.kv_heads, g.tp_rank, g.tp_world), (8, 1, 2));
        assert_eq!(g.slice_bytes(), 256 * 2 * 4 * 128 * 2);
    }

    #[test]
    fn block_bytes_are_checked_and_bad_layouts_refused_by_name() {
        let l = layout(paged("LBHNC", 3, 64), None);
        l.check_block_bytes(96 * 1024).unwrap();
        let e = l.check_block_bytes(96 * 1024 + 64).unwrap_err().to_string();
        assert!(e.contains("98368 bytes") && e.contains("98304"), "{e}");
        let e = layout(LayoutFamily::Recurrent, None)
            .resolve(1)
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("recurrent"));
        let odd = layout(
            LayoutFamily::MlaLatent {
                order: "x".into(),
                latent_dim: 575,
            },
            None,
        );
        assert!(odd.resolve(1).unwrap_err().to_string().contains("575"));
        let mut long = layout(paged("LBHNC", 2, 64), None);
        long.engine = "e".repeat(70);
        assert!(long
            .resolve(1)
            .unwrap_err()
            .to_string()
            .contains("over 64 bytes"));
        let mut bad = layout(paged("L|B", 2, 64), None);
        assert!(bad.resolve(1).is_err());
        bad.family = paged("LBHNC", 0, 64);
        assert!(bad
            .resolve(1)
            .unwrap_err()
            .to_string()
            .contains("kv_heads 0"));
        let grp = layout(
            paged("LBHNC", 2, 64),
            Some(LayoutGroup {
                index: 2,
                count: 2,
                kind: GroupKind::Full,
                structure: "ab".into(),
            }),
        );
        assert!(grp
            .resolve(1)
            .unwrap_err()
            .to_string()
            .contains("group 2 of 2"));
        let op = layout(
            LayoutFamily::Opaque {
                name: "sglang-radix".into(),
                bytes_per_token: 1024,
            },
            None,
        );
        let r = op.resolve(1).unwrap();
        assert_eq!(
            (r.name.as_str(), r.block_bytes),
            ("vllm0.32/cpu-amx/sglang-radix", 128 * 1024)
        );
    }
}
