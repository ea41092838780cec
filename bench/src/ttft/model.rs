//! SmolLM2 (Llama architecture) on candle's CPU backend, written layer by layer so that the
//! prefill of new tokens can wait for each layer's cached prefix KV just before it needs it.
//!
//! Weights come from a GGUF file (SmolLM2-135M-Instruct, Q4_1) and are dequantized to f32 once
//! at load time: candle's f32 matmul (the `gemm` crate) prefills far faster on this CPU than
//! its quantized vec-dot kernels (see docs/benchmarks.md, "Real-model TTFT").
//!
//! Shapes: hidden states are `[tokens, hidden]`; per-layer K and V are `[1, kv_heads, tokens,
//! head_dim]` after RoPE (the cached form); queries `[1, heads, tokens, head_dim]`.

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, IndexOp, Module, Tensor};
use std::path::Path;

/// Model hyper-parameters read from the GGUF metadata (`llama.*` keys).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Config {
    /// Transformer blocks (30 for SmolLM2-135M).
    pub layers: usize,
    /// Embedding width (576).
    pub hidden: usize,
    /// Feed-forward width (1536).
    pub ffn: usize,
    /// Query heads (9).
    pub heads: usize,
    /// KV heads (3): grouped-query attention, `heads / kv_heads` queries per KV head.
    pub kv_heads: usize,
    /// Head dimension (64).
    pub head_dim: usize,
    /// RoPE base (100,000).
    pub rope_base: f32,
    /// RMSNorm epsilon (1e-5).
    pub rms_eps: f32,
    /// Context length the model was trained for (8,192 tokens).
    pub context: usize,
    /// Vocabulary size (49,152).
    pub vocab: usize,
}

/// How the projection weights are held and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Weights {
    /// Dequantized once at load time to f32; f32 matmuls (the default: faster here).
    F32,
    /// Kept in the file's quantized format (Q4_1); candle's quantized matmul kernels.
    Quantized,
}

/// A projection made of one or more weight matrices `[out_i, in]` whose outputs are
/// concatenated (f32 mode fuses Q, K, V and gate, up into one matrix each).
struct Proj(Vec<QMatMul>);

impl Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.0.len() == 1 {
            return Ok(self.0[0].forward(x)?);
        }
        let outs = self
            .0
            .iter()
            .map(|m| m.forward(x))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&outs, 1)?)
    }
}

struct Layer {
    attn_norm: Tensor,
    /// Q, K, V projections, `[heads*hd + 2*kv_heads*hd, hidden]` in all.
    wqkv: Proj,
    wo: Proj,
    ffn_norm: Tensor,
    /// Gate and up projections, `[2*ffn, hidden]` in all.
    w_gate_up: Proj,
    w_down: Proj,
}

/// The loaded model: f32 weights on the CPU and the RoPE tables.
pub struct Model {
    /// Hyper-parameters.
    pub cfg: Config,
    embed: Tensor,
    layers: Vec<Layer>,
    out_norm: Tensor,
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

/// Queries per attention block (bounds the score matrix to `heads x 128 x keys`).
const QUERY_BLOCK: usize = 128;

/// Per-layer K and V of a sequence, each `[1, kv_heads, tokens, head_dim]` f32.
pub type LayerKv = (Tensor, Tensor);

fn meta<'a>(c: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    c.metadata
        .get(key)
        .with_context(|| format!("GGUF metadata has no key {key:?}"))
}

impl Model {
    /// Reads the GGUF at `path`, checks that it is a Llama-architecture model and prepares its
    /// weights as `weights` says (f32: about 540 MB for SmolLM2-135M). Embeddings, norms and
    /// the output head are always f32.
    ///
    /// # Errors
    /// A missing or unreadable file, a non-GGUF file, another architecture, missing tensors.
    pub fn load(path: &Path, weights: Weights) -> Result<(Model, gguf_file::Content)> {
        let mut f = std::fs::File::open(path)
            .with_context(|| format!("opening model file {}", path.display()))?;
        let content = gguf_file::Content::read(&mut f)
            .map_err(|e| anyhow::anyhow!("{}: not a readable GGUF file: {e}", path.display()))?;
        let arch = meta(&content, "general.architecture")?.to_string()?.clone();
        if arch != "llama" {
            bail!(
                "{}: architecture {arch:?} is not supported (only llama)",
                path.display()
            );
        }
        let u = |k: &str| -> Result<usize> {
            Ok(meta(&content, &format!("llama.{k}"))?.to_u32()? as usize)
        };
        let heads = u("attention.head_count")?;
        let hidden = u("embedding_length")?;
        let cfg = Config {
            layers: u("block_count")?,
            hidden,
            ffn: u("feed_forward_length")?,
            heads,
            kv_heads: u("attention.head_count_kv")?,
            head_dim: hidden / heads,
            rope_base: meta(&content, "llama.rope.freq_base")
                .and_then(|v| Ok(v.to_f32()?))
                .unwrap_or(10_000.0),
            rms_eps: meta(&content, "llama.attention.layer_norm_rms_epsilon")?.to_f32()?,
            context: u("context_length")?,
            vocab: meta(&content, "tokenizer.ggml.tokens")?.to_vec()?.len(),
        };
        if !cfg.heads.is_multiple_of(cfg.kv_heads) || !cfg.head_dim.is_multiple_of(2) {
            bail!(
                "unsupported head layout: {} heads, {} KV heads, head dim {}",
                cfg.heads,
                cfg.kv_heads,
                cfg.head_dim
            );
        }
        let device = Device::Cpu;
        let read = |f: &mut std::fs::File, name: &str| -> Result<QTensor> {
            content
                .tensor(f, name, &device)
                .map_err(|e| anyhow::anyhow!("GGUF tensor {name}: {e}"))
        };
        let get = |f: &mut std::fs::File, name: &str| -> Result<Tensor> {
            Ok(read(f, name)?.dequantize(&device)?.to_dtype(DType::F32)?)
        };
        let embed = get(&mut f, "token_embd.weight")?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("blk.{l}");
            let mut proj = |names: &[&str]| -> Result<Proj> {
                match weights {
                    Weights::F32 => {
                        let ts = names
                            .iter()
                            .map(|n| get(&mut f, &format!("{p}.{n}.weight")))
                            .collect::<Result<Vec<_>>>()?;
                        Ok(Proj(vec![QMatMul::Tensor(Tensor::cat(&ts, 0)?)]))
                    }
                    Weights::Quantized => Ok(Proj(
                        names
                            .iter()
                            .map(|n| {
                                Ok(QMatMul::from_qtensor(read(
                                    &mut f,
                                    &format!("{p}.{n}.weight"),
                                )?)?)
                            })
                            .collect::<Result<Vec<_>>>()?,
                    )),
                }
            };
            let wqkv = proj(&["attn_q", "attn_k", "attn_v"])?;
            let wo = proj(&["attn_output"])?;
            let w_gate_up = proj(&["ffn_gate", "ffn_up"])?;
            let w_down = proj(&["ffn_down"])?;
            layers.push(Layer {
                attn_norm: get(&mut f, &format!("{p}.attn_norm.weight"))?,
                wqkv,
                wo,
                ffn_norm: get(&mut f, &format!("{p}.ffn_norm.weight"))?,
                w_gate_up,
                w_down,
            });
        }
        let out_norm = get(&mut f, "output_norm.weight")?;
        // Tied embeddings (SmolLM2) have no separate output matrix.
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            get(&mut f, "output.weight")?
        } else {
            embed.clone()
        };
        // RoPE tables, interleaved pairs as GGUF's Q/K weights expect (candle's rope_i).
        let half = cfg.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / cfg.rope_base.powf(2.0 * i as f32 / cfg.head_dim as f32))
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), &device)?;
        let pos = Tensor::arange(0u32, cfg.context as u32, &device)?
            .to_dtype(DType::F32)?
            .reshape((cfg.context, 1))?;
        let freqs = pos.broadcast_mul(&inv)?;
        let model = Model {
            cos: freqs.cos()?,
            sin: freqs.sin()?,
            cfg,
            embed,
            layers,
            out_norm,
            lm_head,
            device,
        };
        Ok((model, content))
    }

    /// Embeds `tokens`: `[tokens, hidden]`.
    ///
    /// # Errors
    /// A token id outside the vocabulary.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            bail!(
                "token id {t} is outside the vocabulary of {}",
                self.cfg.vocab
            );
        }
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed.index_select(&ids, 0)?)
    }

    /// First half of layer `l` for `n` new tokens at positions `pos0..pos0+n`: returns the
    /// normalised queries `[1, heads, n, hd]` and the new tokens' K, V `[1, kv_heads, n, hd]`
    /// (after RoPE). Needs no cached KV, so it runs before the layer's prefix is waited for.
    pub fn qkv(&self, l: usize, x: &Tensor, pos0: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.cfg;
        let layer = &self.layers[l];
        let n = x.dim(0)?;
        if pos0 + n > c.context {
            bail!(
                "sequence of {} tokens exceeds the model's context of {}",
                pos0 + n,
                c.context
            );
        }
        let h = candle_nn::ops::rms_norm(x, &layer.attn_norm, c.rms_eps)?;
        let qkv = layer.wqkv.forward(&h)?;
        let qd = c.heads * c.head_dim;
        let kd = c.kv_heads * c.head_dim;
        let split = |off: usize, len: usize, heads: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(1, off, len)?
                .reshape((1, n, heads, c.head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let cos = self.cos.narrow(0, pos0, n)?;
        let sin = self.sin.narrow(0, pos0, n)?;
        let q = candle_nn::rotary_emb::rope_i(&split(0, qd, c.heads)?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_i(&split(qd, kd, c.kv_heads)?, &cos, &sin)?;
        let v = split(qd + kd, kd, c.kv_heads)?;
        Ok((q, k, v))
    }

    /// Second half of layer `l`: causal attention of the new tokens' queries over the full K,
    /// V (`[1, kv_heads, pos0 + n, hd]`: cached prefix then new tokens), output projection,
    /// residual, SwiGLU feed-forward, residual. Returns the new hidden states `[n, hidden]`.
    pub fn attend_ffn(
        &self,
        l: usize,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let layer = &self.layers[l];
        let n = x.dim(0)?;
        let total = k.dim(2)?;
        let pos0 = total - n;
        let group = c.heads / c.kv_heads;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        // Attention in blocks of queries: bounded temporaries, and each block reads only the
        // keys it may see (causal), so a full prefill does about half the attention work.
        let mut blocks = Vec::with_capacity(n.div_ceil(QUERY_BLOCK));
        for start in (0..n).step_by(QUERY_BLOCK) {
            let nb = QUERY_BLOCK.min(n - start);
            let visible = pos0 + start + nb;
            // Query heads g*group..(g+1)*group share KV head g: fold them into rows.
            let qg = q.narrow(2, start, nb)?.contiguous()?.reshape((
                1,
                c.kv_heads,
                group * nb,
                c.head_dim,
            ))?;
            let kb = k.narrow(2, 0, visible)?;
            let vb = v.narrow(2, 0, visible)?;
            let scores = (qg.matmul(&kb.t()?)? * scale)?.reshape((1, c.heads, nb, visible))?;
            let scores = if nb > 1 {
                let first = pos0 + start;
                let mask: Vec<f32> = (0..nb)
                    .flat_map(|i| {
                        (0..visible).map(move |j| {
                            if j <= first + i {
                                0.0
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                    })
                    .collect();
                scores.broadcast_add(&Tensor::from_vec(mask, (nb, visible), &self.device)?)?
            } else {
                scores
            };
            let p = candle_nn::ops::softmax_last_dim(&scores)?;
            blocks.push(
                p.reshape((1, c.kv_heads, group * nb, visible))?
                    .matmul(&vb.contiguous()?)?
                    .reshape((1, c.heads, nb, c.head_dim))?,
            );
        }
        let att = Tensor::cat(&blocks, 2)?
            .transpose(1, 2)?
            .reshape((n, c.heads * c.head_dim))?;
        let x = (x + layer.wo.forward(&att)?)?;
        let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
        let gu = layer.w_gate_up.forward(&h)?;
        let act = (gu.narrow(1, 0, c.ffn)?.silu()? * gu.narrow(1, c.ffn, c.ffn)?)?;
        Ok((x + layer.w_down.forward(&act)?)?)
    }

    /// Logits of the last position of `x` (`[tokens, hidden]`): `[vocab]` f32.
    pub fn last_logits(&self, x: &Tensor) -> Result<Vec<f32>> {
        let n = x.dim(0)?;
        let last = x.i(n - 1..n)?;
        let h = candle_nn::ops::rms_norm(&last, &self.out_norm, self.cfg.rms_eps)?;
        Ok(h.matmul(&self.lm_head.t()?)?.squeeze(0)?.to_vec1::<f32>()?)
    }

    /// Runs `tokens` at positions `pos0..` through every layer. `prefix(l)` is called once per
    /// layer, after the new tokens' Q, K, V are computed and before attention, and returns that
    /// layer's cached K, V for positions `0..pos0` (`[1, kv_heads, pos0, hd]`) or `None` when
    /// `pos0 == 0`: this is where a layerwise load is waited for. Returns the last position's
    /// logits and every layer's full K, V (`0..pos0 + tokens`).
    ///
    /// # Errors
    /// Tensor shape errors, a prefix of the wrong length, or an error from `prefix`.
    pub fn forward(
        &self,
        tokens: &[u32],
        pos0: usize,
        mut prefix: impl FnMut(usize) -> Result<Option<LayerKv>>,
    ) -> Result<(Vec<f32>, Vec<LayerKv>)> {
        if tokens.is_empty() {
            bail!("forward: no tokens to compute");
        }
        let mut x = self.embed(tokens)?;
        let mut kvs = Vec::with_capacity(self.cfg.layers);
        for l in 0..self.cfg.layers {
            let (q, k, v) = self.qkv(l, &x, pos0)?;
            let (k, v) = match prefix(l)? {
                Some((pk, pv)) => {
                    if pk.dim(2)? != pos0 || pv.dim(2)? != pos0 {
                        bail!(
                            "layer {l}: cached prefix holds {} tokens, expected {pos0}",
                            pk.dim(2)?
                        );
                    }
                    (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?)
                }
                None if pos0 == 0 => (k, v),
                None => bail!("layer {l}: no cached prefix for positions 0..{pos0}"),
            };
            x = self.attend_ffn(l, &x, &q, &k, &v)?;
            kvs.push((k, v));
        }
        Ok((self.last_logits(&x)?, kvs))
    }

    /// Greedy decoding: starting from `first` (the token chosen from the prefill's logits) and
    /// the sequence's per-layer K, V, produces `count` tokens in all (including `first`),
    /// stopping early after `eos`.
    ///
    /// # Errors
    /// As for [`Model::forward`].
    pub fn greedy(
        &self,
        first: u32,
        mut kvs: Vec<LayerKv>,
        count: usize,
        eos: Option<u32>,
    ) -> Result<Vec<u32>> {
        let mut out = vec![first];
        while out.len() < count && Some(*out.last().unwrap()) != eos {
            let pos0 = kvs[0].0.dim(2)?;
            let tok = *out.last().unwrap();
            let mut cache = std::mem::take(&mut kvs);
            let (logits, new) = self.forward(&[tok], pos0, |l| Ok(Some(cache[l].clone())))?;
            cache.clear();
            kvs = new;
            out.push(argmax(&logits));
        }
        Ok(out)
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}
