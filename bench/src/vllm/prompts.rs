//! The benchmark's prompts, token-exact: per prefix length a synthetic ship's log of exactly
//! that many tokens, request A's and B's questions, the warm-up and the paired misses.

use super::{VllmArgs, BLOCK, METHODS};
use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::path::Path;

/// Token-exact prompts: per prefix length a document of exactly that many tokens (each its
/// own text, so prefixes never share blocks), per run a question of exactly `new_tokens`.
pub(super) struct Prompts {
    docs: HashMap<u32, Vec<u32>>,
    save_q: Vec<u32>,
    questions: Vec<Vec<u32>>,
    pub(super) warmup: Vec<u32>,
}

impl Prompts {
    pub(super) fn new(model: &Path, a: &VllmArgs) -> Result<Self> {
        let tok = tokenizers::Tokenizer::from_file(model.join("tokenizer.json"))
            .map_err(|e| anyhow!("tokenizer of {}: {e}", model.display()))?;
        let enc = |s: &str| -> Result<Vec<u32>> {
            Ok(tok
                .encode(s, false)
                .map_err(|e| anyhow!("tokenize: {e}"))?
                .get_ids()
                .to_vec())
        };
        let mut docs = HashMap::new();
        for &p in &a.prefixes {
            let mut t = Vec::new();
            let mut i = 0;
            while t.len() < p as usize {
                t.extend(enc(&paragraph(p, i))?);
                i += 1;
            }
            t.truncate(p as usize);
            docs.insert(p, t);
        }
        let question = |i: usize| -> Result<Vec<u32>> {
            let mut t = enc(&format!(
                "\n\nQuestion {i}: in the log above, which vessel reported the calmest water \
                 on the {} leg, and what did its crew repair there? Answer briefly:",
                ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"][i % 7]
            ))?;
            while t.len() < a.new_tokens as usize {
                let more = t.clone();
                t.extend(more);
            }
            t.truncate(a.new_tokens as usize);
            Ok(t)
        };
        let questions = (0..a.runs)
            .map(|r| question(r + 1))
            .collect::<Result<Vec<_>>>()?;
        let save_q = question(0)?;
        let mut warmup = enc("Write one short sentence about the sea.")?;
        warmup.truncate(BLOCK as usize - 8);
        Ok(Prompts {
            docs,
            save_q,
            questions,
            warmup,
        })
    }

    pub(super) fn a(&self, p: u32) -> Vec<u32> {
        [self.docs[&p].as_slice(), &self.save_q].concat()
    }

    pub(super) fn b(&self, p: u32, r: usize) -> Vec<u32> {
        [self.docs[&p].as_slice(), &self.questions[r]].concat()
    }

    /// Request B with its first token replaced by one unique to (run, method): the same
    /// length, and a prefix no cache holds (vLLM's, ObjectCache's, the peers').
    pub(super) fn miss(&self, p: u32, r: usize, method: &str) -> Vec<u32> {
        let mut t = self.b(p, r);
        let m = METHODS.iter().position(|x| *x == method).unwrap_or(0) as u32;
        let first = 1000 + 97 * m + r as u32;
        t[0] = if t[0] == first { first + 50 } else { first };
        t
    }
}

/// A paragraph of the synthetic ship's log of prefix `p` (seeded by `p`).
fn paragraph(p: u32, i: usize) -> String {
    let ships = [
        "Aster", "Boreal", "Cygnet", "Dunlin", "Egret", "Fulmar", "Gannet", "Heron",
    ];
    let ports = [
        "Tromso",
        "Valparaiso",
        "Hobart",
        "Reykjavik",
        "Cork",
        "Halifax",
        "Nome",
    ];
    let cargo = [
        "sensor buoys",
        "rope",
        "diesel",
        "core samples",
        "spare radios",
        "tinned fish",
    ];
    let k = i + p as usize / BLOCK as usize * 7;
    format!(
        "Log {p}-{i}. The vessel {} left {} on day {} with {} crates of {}; winds {} knots, \
         water at {} degrees; the crew repaired the {} and reached {} after {} days.\n",
        ships[k % 8],
        ports[(3 * k) % 7],
        7 + 3 * k,
        12 + 5 * k,
        cargo[k % 6],
        9 + (7 * k) % 30,
        2 + (5 * k) % 11,
        ["winch", "radar", "hull", "galley", "mast"][k % 5],
        ports[(3 * k + 2) % 7],
        1 + k % 4
    )
}
