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
            bail!(
                "KV dtype {} is not supported by the real-model benchmark (fp32 or bf16)",
                g.dtype
            );
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
            Dtype::Bf16 => vals
                .iter()
                .for_each(|x| out.extend_from_slice(&half::bf16::from_f32(*x).to_le_bytes())),
            _ => vals
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        }
    }

    fn get(&self, bytes: &[u8], out: &mut Vec<f32>) {
        match self.dtype {
            Dtype::Bf16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            _ => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
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
                bail!(
                    "layer KV holds {} tokens, {n} needed for {chunks} chunks",
                    t.dim(2)?
                );
            }
            // [1, kvh, T, hd] -> [n, kvh, hd], row-major.
            Ok(t.narrow(2, 0, n)?
                .squeeze(0)?
                .transpose(0, 1)?
                .contiguous()?
                .flatten_all()?
                .to_vec1::<f32>()?)
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
        if buf.is_empty() || !buf.len().is_multiple_of(sb) {
            bail!(
                "layer buffer of {} bytes is not a whole number of {sb}-byte chunk slices",
                buf.len()
            );
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

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(tokens: usize, kvh: usize, hd: usize, salt: f32) -> LayerKv {
        let n = kvh * tokens * hd;
        let t = |off: f32| {
            let v: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 0.37 + off).sin() * 3.0)
                .collect();
            Tensor::from_vec(v, (1, kvh, tokens, hd), &Device::Cpu).unwrap()
        };
        (t(salt), t(salt + 100.0))
    }

    /// SmolLM2-135M's geometry with 4-token chunks of `dtype`, and its codec.
    fn codec(dtype: Dtype) -> (KvGeometry, KvCodec) {
        let g = KvGeometry::smollm2_135m()
            .with_tokens_per_chunk(4)
            .unwrap()
            .with_dtype(dtype);
        let c = KvCodec::new(&g).unwrap();
        (g, c)
    }

    /// Token `i` of a `[1, heads, tokens, head_dim]` tensor, every head's elements in order
    /// (the order of a token's elements in a slice).
    fn token(t: &Tensor, i: usize) -> Vec<f32> {
        t.squeeze(0)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .get(i)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn fp32_round_trip_is_exact_and_layer_major() {
        let (g, c) = codec(Dtype::Fp32);
        assert_eq!(c.slice_bytes() as u64, g.slice_bytes());
        let (k, v) = kv(9, 3, 64, 0.5);
        let bytes = c.encode_layer(&(k.clone(), v.clone()), 2).unwrap();
        assert_eq!(bytes.len(), 2 * c.slice_bytes());
        // Chunk 1's slice starts with K of token 4, head 0, element 0.
        let k4 = token(&k, 4);
        let off = c.slice_bytes();
        assert_eq!(&bytes[off..off + 4], &k4[0].to_le_bytes());
        // V of chunk 0 starts half-way into its slice, at token 0.
        let v0 = token(&v, 0);
        assert_eq!(&bytes[off / 2..off / 2 + 4], &v0[0].to_le_bytes());
        let (dk, dv) = c.decode_layer(&bytes, &Device::Cpu).unwrap();
        let exp = |t: &Tensor| {
            t.narrow(2, 0, 8)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(exp(&dk), exp(&k));
        assert_eq!(exp(&dv), exp(&v));
    }

    #[test]
    fn bf16_round_trip_is_close_and_half_the_bytes() {
        let (g, c) = codec(Dtype::Bf16);
        let (k, v) = kv(4, 3, 64, 1.5);
        let bytes = c.encode_layer(&(k.clone(), v.clone()), 1).unwrap();
        assert_eq!(bytes.len() as u64, g.slice_bytes());
        let (dk, _) = c.decode_layer(&bytes, &Device::Cpu).unwrap();
        let a = dk.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= y.abs() / 128.0 + 1e-6, "{x} vs {y}");
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let (g, c) = codec(Dtype::Fp32);
        assert!(c.decode_layer(&[0u8; 10], &Device::Cpu).is_err());
        assert!(c.encode_layer(&kv(3, 3, 64, 0.0), 1).is_err());
        assert!(KvCodec::new(&g.with_dtype(Dtype::Fp8E4m3)).is_err());
    }
}
