//! Conversion between the model's per-layer K, V tensors and ObjectCache's layer-major bytes.
//!
//! One layer's destination buffer for `chunks` chunks is `chunks x slice_bytes` bytes; chunk
//! `c`'s slice sits at `c x slice_bytes` and holds K of its `tokens_per_chunk` tokens, then V,
//! each `[tokens, kv_heads, head_dim]` little-endian in the geometry's dtype (the object
//! format's layer-major layout, docs/object-format.md).

use super::model::LayerKv;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use objectcache::layout::{Dtype, KvGeometry};

/// Encodes and decodes one layer's K, V for a geometry (fp32 or bf16).
#[derive(Debug, Clone)]
pub struct KvCodec {
    tpc: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: Dtype,
}

impl KvCodec {
    /// A codec for `g` (TP world 1).
    ///
    /// # Errors
    /// A dtype other than fp32 or bf16, or a TP-split geometry.
    pub fn new(g: &KvGeometry) -> Result<Self> {
        if !matches!(g.dtype, Dtype::Fp32 | Dtype::Bf16) {
            bail!("KV dtype {} is not supported by the real-model benchmark (fp32 or bf16)", g.dtype);
        }
        if g.tp_world != 1 {
            bail!("the real-model benchmark runs without tensor parallelism (tp_world 1)");
        }
        Ok(KvCodec {
            tpc: g.tokens_per_chunk as usize,
            kv_heads: g.kv_heads as usize,
            head_dim: g.head_dim as usize,
            dtype: g.dtype,
        })
    }

    /// Elements of one token's K (or V) in one layer.
    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one chunk's slice of one layer (K then V), as `KvGeometry::slice_bytes`.
    pub fn slice_bytes(&self) -> usize {
        2 * self.tpc * self.row() * self.dtype.bytes() as usize
    }

    fn put(&self, vals: &[f32], out: &mut Vec<u8>) {
        match self.dtype {
            Dtype::Bf16 => vals.iter().for_each(|x| out.extend_from_slice(&half::bf16::from_f32(*x).to_le_bytes())),
            _ => vals.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        }
    }

    fn get(&self, bytes: &[u8], out: &mut Vec<f32>) {
        match self.dtype {
            Dtype::Bf16 => out.extend(bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())),
            _ => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        }
    }

    /// Layer-major bytes of chunks `0..chunks` of one layer's K, V (`[1, kv_heads, T, hd]`,
    /// `T >= chunks x tokens_per_chunk`): `chunks x slice_bytes` bytes.
    ///
    /// # Errors
    /// Too few tokens in `kv`, or tensor errors.
    pub fn encode_layer(&self, kv: &LayerKv, chunks: usize) -> Result<Vec<u8>> {
        let n = chunks * self.tpc;
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            if t.dim(2)? < n {
                bail!("layer KV holds {} tokens, {n} needed for {chunks} chunks", t.dim(2)?);
            }
            // [1, kvh, T, hd] -> [n, kvh, hd], row-major.
            Ok(t.narrow(2, 0, n)?.squeeze(0)?.transpose(0, 1)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?)
        };
        let (k, v) = (flat(&kv.0)?, flat(&kv.1)?);
        let per_chunk = self.tpc * self.row();
        let mut out = Vec::with_capacity(chunks * self.slice_bytes());
        for c in 0..chunks {
            self.put(&k[c * per_chunk..(c + 1) * per_chunk], &mut out);
            self.put(&v[c * per_chunk..(c + 1) * per_chunk], &mut out);
        }
        Ok(out)
    }

    /// Inverse of [`KvCodec::encode_layer`]: K, V `[1, kv_heads, chunks x tpc, hd]` f32.
    ///
    /// # Errors
    /// A buffer whose length is not a whole number of slices.
    pub fn decode_layer(&self, buf: &[u8], dev: &Device) -> Result<LayerKv> {
        let sb = self.slice_bytes();
        if buf.is_empty() || buf.len() % sb != 0 {
            bail!("layer buffer of {} bytes is not a whole number of {sb}-byte chunk slices", buf.len());
        }
        let chunks = buf.len() / sb;
        let n = chunks * self.tpc;
        let mut k = Vec::with_capacity(n * self.row());
        let mut v = Vec::with_capacity(n * self.row());
        for s in buf.chunks_exact(sb) {
            let (kb, vb) = s.split_at(sb / 2);
            self.get(kb, &mut k);
            self.get(vb, &mut v);
        }
        let t = |x: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(x, (n, self.kv_heads, self.head_dim), dev)?
                .transpose(0, 1)?
                .contiguous()?
                .unsqueeze(0)?)
        };
        Ok((t(k)?, t(v)?))
    }
}
