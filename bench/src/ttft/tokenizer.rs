//! The tokenizer carried in the GGUF metadata: GPT-2 style byte-level BPE (`tokenizer.ggml.*`
//! keys), assembled from the `tokenizers` crate's BPE model, pre-tokenizers and decoder.
//!
//! SmolLM2's pre-tokenization (GGUF pre-tokenizer name `smollm`) splits digits one by one and
//! then applies GPT-2's byte-level regex split without a prefix space; control tokens
//! (`<|im_start|>`, `<|im_end|>`, ...) are matched whole as special tokens.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

/// GGUF token type of control tokens (llama.cpp's `LLAMA_TOKEN_TYPE_CONTROL`).
const TOKEN_TYPE_CONTROL: i32 = 3;

/// A text tokenizer with the model's special token ids.
pub struct TextTokenizer {
    inner: Tokenizer,
    /// End-of-sequence id (`tokenizer.ggml.eos_token_id`; 2 for SmolLM2).
    pub eos: Option<u32>,
}

fn strings(v: &Value, key: &str) -> Result<Vec<String>> {
    v.to_vec()
        .map_err(|e| anyhow!("GGUF {key}: {e}"))?
        .iter()
        .map(|s| {
            s.to_string()
                .cloned()
                .map_err(|e| anyhow!("GGUF {key}: {e}"))
        })
        .collect()
}

impl TextTokenizer {
    /// Builds the tokenizer from GGUF metadata.
    ///
    /// # Errors
    /// Missing `tokenizer.ggml.tokens` / `merges`, a tokenizer model other than `gpt2`, or a
    /// malformed merge line.
    pub fn from_gguf(c: &Content) -> Result<Self> {
        let get = |k: &str| {
            c.metadata
                .get(k)
                .with_context(|| format!("GGUF metadata has no key {k:?}"))
        };
        let kind = get("tokenizer.ggml.model")?.to_string()?.clone();
        if kind != "gpt2" {
            bail!("tokenizer model {kind:?} is not supported (only gpt2 byte-level BPE)");
        }
        let tokens = strings(get("tokenizer.ggml.tokens")?, "tokenizer.ggml.tokens")?;
        let merges = strings(get("tokenizer.ggml.merges")?, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .with_context(|| format!("GGUF merge {m:?} is not two symbols"))
            })
            .collect::<Result<Vec<_>>>()?;
        let types: Vec<i32> = match c.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<candle_core::Result<_>>()?,
            None => vec![1; tokens.len()],
        };
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| anyhow!("building the BPE model from GGUF: {e}"))?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| anyhow!("adding special tokens: {e}"))?;
        let eos = c
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.to_u32().ok());
        Ok(TextTokenizer { inner, eos })
    }

    /// Token ids of `text` (special tokens in the text are recognised; no BOS is added).
    ///
    /// # Errors
    /// The tokenizer's own errors.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`, special tokens included.
    ///
    /// # Errors
    /// The tokenizer's own errors.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding: {e}"))
    }
}
