//! How one training example becomes forward passes: the token sequences to run, their attention
//! masks and positions, and for each branch (chosen, rejected, or the SFT completion) which rows of
//! which sequence predict which target tokens.
//!
//! With prefix sharing, a preference pair is ONE sequence `[P; Rc; Rr]`: both responses start at
//! logical position |P|, rejected tokens never see chosen ones, and the head reads
//! chosen[k] ← H[P−1+k], rejected[0] ← H[P−1], rejected[k≥1] ← H[P+Rc+k−1].
//!
//! Packing (`pack`): several one-sequence plans end to end in one sequence, each block seeing only
//! its own keys (the mask's key ranges shifted by the block's offset) at its own positions, so
//! every layer computes for each block exactly what it computes for the block alone.
//!
//! The masks here carry the layout only; each layer applies its own sliding window
//! (`model::runner`).

use crate::data::TokenizedPair;
use crate::tensor::AttnMask;
use anyhow::{ensure, Result};

pub struct Sequence {
    pub ids: Vec<u32>,
    pub mask: AttnMask,
}

/// Rows of one sequence and the tokens they predict.
#[derive(Default, Clone)]
pub struct Rows {
    pub seq: usize,
    pub rows: Vec<u32>,
    pub targets: Vec<u32>,
}

/// One branch's prompt rows (used by full-scope NLL) and response rows.
pub struct Branch {
    pub prompt: Rows,
    pub response: Rows,
}

pub struct Plan {
    pub seqs: Vec<Sequence>,
    pub chosen: Branch,
    pub rejected: Option<Branch>,
}

/// Rows predicting `tokens[1..]` of the prompt (positions 0..P−2).
fn prompt_rows(seq: usize, prompt: &[u32]) -> Rows {
    let n = prompt.len().saturating_sub(1);
    Rows {
        seq,
        rows: (0..n as u32).collect(),
        targets: prompt.get(1..).unwrap_or_default().to_vec(),
    }
}

impl Plan {
    /// A preference pair, as one prefix-shared sequence or as two sequences.
    pub fn pair(p: &TokenizedPair, prefix_shared: bool) -> Result<Plan> {
        let (np, nc, nr) = (p.prompt.len(), p.chosen.len(), p.rejected.len());
        ensure!(np >= 1, "a preference example needs a non-empty prompt");
        ensure!(
            nc >= 1 && nr >= 1,
            "a preference example needs non-empty responses"
        );
        if prefix_shared {
            let mut ids = p.prompt.clone();
            ids.extend(&p.chosen);
            ids.extend(&p.rejected);
            let mask = AttnMask::prefix_shared(np, nc, nr);
            let chosen = Branch {
                prompt: prompt_rows(0, &p.prompt),
                response: Rows {
                    seq: 0,
                    rows: (0..nc).map(|k| (np - 1 + k) as u32).collect(),
                    targets: p.chosen.clone(),
                },
            };
            let rej_rows = (0..nr)
                .map(|k| {
                    if k == 0 {
                        (np - 1) as u32
                    } else {
                        (np + nc + k - 1) as u32
                    }
                })
                .collect();
            let rejected = Branch {
                prompt: prompt_rows(0, &p.prompt),
                response: Rows {
                    seq: 0,
                    rows: rej_rows,
                    targets: p.rejected.clone(),
                },
            };
            return Ok(Plan {
                seqs: vec![Sequence { ids, mask }],
                chosen,
                rejected: Some(rejected),
            });
        }
        let mk = |seq: usize, resp: &[u32]| -> (Sequence, Branch) {
            let mut ids = p.prompt.clone();
            ids.extend(resp);
            let mask = AttnMask::causal(ids.len());
            let b = Branch {
                prompt: prompt_rows(seq, &p.prompt),
                response: Rows {
                    seq,
                    rows: (0..resp.len()).map(|k| (np - 1 + k) as u32).collect(),
                    targets: resp.to_vec(),
                },
            };
            (Sequence { ids, mask }, b)
        };
        let (s0, chosen) = mk(0, &p.chosen);
        let (s1, rejected) = mk(1, &p.rejected);
        Ok(Plan {
            seqs: vec![s0, s1],
            chosen,
            rejected: Some(rejected),
        })
    }

    /// An SFT example: one sequence; the completion rows are the response branch. With an empty
    /// prompt the first completion token has no predecessor and is not trained.
    pub fn sft(prompt: &[u32], completion: &[u32]) -> Result<Plan> {
        ensure!(
            !completion.is_empty(),
            "an SFT example needs a non-empty completion"
        );
        let mut ids = prompt.to_vec();
        ids.extend(completion);
        let np = prompt.len();
        let (rows, targets): (Vec<u32>, Vec<u32>) = (0..completion.len())
            .filter(|&k| np + k >= 1)
            .map(|k| ((np + k - 1) as u32, completion[k]))
            .unzip();
        ensure!(!rows.is_empty(), "an SFT example needs at least two tokens");
        let mask = AttnMask::causal(ids.len());
        Ok(Plan {
            seqs: vec![Sequence { ids, mask }],
            chosen: Branch {
                prompt: prompt_rows(0, prompt),
                response: Rows {
                    seq: 0,
                    rows,
                    targets,
                },
            },
            rejected: None,
        })
    }

    /// Tokens run through the model.
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.ids.len()).sum()
    }
}

/// One-sequence plans end to end in one sequence (`pack`): the sequence, and each plan's
/// offset in it.
pub struct Packed {
    pub seq: Sequence,
    pub offsets: Vec<usize>,
}

/// `plans` (each one sequence: a prefix-shared pair or an SFT example) packed into one
/// sequence with a block-diagonal mask and per-block positions.
pub fn pack(plans: &[&Plan]) -> Result<Packed> {
    let mut ids = Vec::new();
    let mut mask = AttnMask {
        ranges: Vec::new(),
        positions: Vec::new(),
        window: None,
    };
    let mut offsets = Vec::with_capacity(plans.len());
    for (i, p) in plans.iter().enumerate() {
        ensure!(
            p.seqs.len() == 1,
            "packing example {i}: it runs as {} sequences (packing needs prefix_shared pairs or              SFT examples)",
            p.seqs.len()
        );
        let s = &p.seqs[0];
        let o = ids.len() as u32;
        offsets.push(o as usize);
        ids.extend(&s.ids);
        let shift = |a: u32, b: u32| if b > a { (a + o, b + o) } else { (0, 0) };
        for r in &s.mask.ranges {
            let (a0, a1) = shift(r[0], r[1]);
            let (b0, b1) = shift(r[2], r[3]);
            mask.ranges.push([a0, a1, b0, b1]);
        }
        mask.positions.extend(&s.mask.positions);
    }
    ensure!(
        u32::try_from(ids.len()).is_ok(),
        "a pack of {} tokens",
        ids.len()
    );
    Ok(Packed {
        seq: Sequence { ids, mask },
        offsets,
    })
}

/// `rows` of a packed plan's sequence, shifted to where the plan lies in the pack.
pub fn shifted(rows: &Rows, offset: usize) -> Rows {
    Rows {
        seq: 0,
        rows: rows.rows.iter().map(|&r| r + offset as u32).collect(),
        targets: rows.targets.clone(),
    }
}
