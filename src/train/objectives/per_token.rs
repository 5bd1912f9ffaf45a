//! The objectives on per-token logps, with a gradient for every token: each token checked
//! (finite, not positive), the branch reduced to its sums ([`BranchSums`]), the `*_sums`
//! function applied, and its per-part constants broadcast back over the tokens. Tests only:
//! the training step evaluates the sums form where the logps live (`train::device_loss`).

use super::*;

/// Per-token log-probabilities of one branch (one sequence).
#[derive(Clone, Copy, Debug)]
pub struct BranchLogps<'a> {
    /// Per-token logps over the prompt tokens; may be empty (only ORPO full-scope NLL and
    /// SFT with `all_tokens` read it).
    pub prompt: &'a [f32],
    /// Per-token logps over the response (completion) tokens; must be non-empty.
    pub response: &'a [f32],
}

impl<'a> BranchLogps<'a> {
    pub fn new(prompt: &'a [f32], response: &'a [f32]) -> Self {
        BranchLogps { prompt, response }
    }

    /// A branch without prompt logps.
    pub fn response_only(response: &'a [f32]) -> Self {
        BranchLogps {
            prompt: &[],
            response,
        }
    }
}

/// `d loss / d logp` for one branch, same lengths as the corresponding [`BranchLogps`].
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BranchGrads {
    pub prompt: Vec<f32>,
    pub response: Vec<f32>,
}

/// Result of one objective on one example.
#[derive(Clone, Debug, PartialEq)]
pub struct ObjectiveOut {
    pub loss: f64,
    pub metrics: Metrics,
    /// Gradient w.r.t. the chosen branch (for [`sft`]: the only branch).
    pub d_chosen: BranchGrads,
    /// Gradient w.r.t. the rejected branch (for [`sft`]: empty vectors).
    pub d_rejected: BranchGrads,
}

/// ORPO per token ([`orpo_sums`]).
pub fn orpo(
    chosen: BranchLogps,
    rejected: BranchLogps,
    lambda: f64,
    scope: SftScope,
) -> Result<ObjectiveOut, String> {
    orpo64(
        &Branch64::from(chosen),
        &Branch64::from(rejected),
        lambda,
        scope,
    )
    .map(Out64::into_f32)
}

/// SFT per token ([`sft_sums`]). The result's `d_rejected` is empty.
pub fn sft(logps: BranchLogps, all_tokens: bool) -> Result<ObjectiveOut, String> {
    sft64(&Branch64::from(logps), all_tokens).map(Out64::into_f32)
}

/// DPO per token ([`dpo_sums`]); `ref_*_sum` are the reference model's response sums.
#[allow(clippy::too_many_arguments)]
pub fn dpo(
    policy_chosen: BranchLogps,
    policy_rejected: BranchLogps,
    ref_chosen_sum: f64,
    ref_rejected_sum: f64,
    beta: f64,
    label_smoothing: f64,
    loss_type: DpoLossType,
) -> Result<ObjectiveOut, String> {
    dpo64(
        &Branch64::from(policy_chosen),
        &Branch64::from(policy_rejected),
        ref_chosen_sum,
        ref_rejected_sum,
        beta,
        label_smoothing,
        loss_type,
    )
    .map(Out64::into_f32)
}

/// SimPO per token ([`simpo_sums`]).
pub fn simpo(
    chosen: BranchLogps,
    rejected: BranchLogps,
    beta: f64,
    gamma: f64,
) -> Result<ObjectiveOut, String> {
    simpo64(
        &Branch64::from(chosen),
        &Branch64::from(rejected),
        beta,
        gamma,
    )
    .map(Out64::into_f32)
}

#[derive(Clone, Debug)]
pub struct Branch64 {
    pub prompt: Vec<f64>,
    pub response: Vec<f64>,
}

impl From<BranchLogps<'_>> for Branch64 {
    fn from(b: BranchLogps<'_>) -> Self {
        Branch64 {
            prompt: b.prompt.iter().map(|&x| x as f64).collect(),
            response: b.response.iter().map(|&x| x as f64).collect(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Grads64 {
    pub prompt: Vec<f64>,
    pub response: Vec<f64>,
}

impl Grads64 {
    fn zeros_like(b: &Branch64) -> Self {
        Grads64 {
            prompt: vec![0.0; b.prompt.len()],
            response: vec![0.0; b.response.len()],
        }
    }

    fn empty() -> Self {
        Grads64 {
            prompt: Vec::new(),
            response: Vec::new(),
        }
    }

    pub fn to_f32(&self) -> BranchGrads {
        BranchGrads {
            prompt: self.prompt.iter().map(|&x| x as f32).collect(),
            response: self.response.iter().map(|&x| x as f32).collect(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Out64 {
    pub loss: f64,
    pub metrics: Metrics,
    pub d_chosen: Grads64,
    pub d_rejected: Grads64,
}

impl Out64 {
    fn into_f32(self) -> ObjectiveOut {
        ObjectiveOut {
            loss: self.loss,
            metrics: self.metrics,
            d_chosen: self.d_chosen.to_f32(),
            d_rejected: self.d_rejected.to_f32(),
        }
    }
}

fn check_tokens(obj: &str, branch: &str, part: &str, v: &[f64]) -> Result<(), String> {
    for (i, &x) in v.iter().enumerate() {
        if !x.is_finite() {
            return Err(format!(
                "{obj}: {branch} {part} logp[{i}] is not finite ({x})"
            ));
        }
        if x > LOGP_POSITIVE_TOLERANCE {
            return Err(format!(
                "{obj}: {branch} {part} logp[{i}] = {x} is positive; not a log-probability"
            ));
        }
    }
    Ok(())
}

fn check_branch(obj: &str, branch: &str, b: &Branch64) -> Result<(), String> {
    if b.response.is_empty() {
        return Err(format!(
            "{obj}: {branch} response is empty (need at least one response token)"
        ));
    }
    check_tokens(obj, branch, "prompt", &b.prompt)?;
    check_tokens(obj, branch, "response", &b.response)
}

impl BranchSums {
    fn of(b: &Branch64) -> BranchSums {
        BranchSums {
            prompt: b.prompt.iter().sum(),
            n_prompt: b.prompt.len(),
            response: b.response.iter().sum(),
            n_response: b.response.len(),
        }
    }
}

impl SumsOut {
    /// Broadcasts the per-part constants over the branches' tokens.
    fn into_tokens(self, c: &Branch64, r: Option<&Branch64>) -> Out64 {
        let mut dc = Grads64::zeros_like(c);
        dc.prompt.iter_mut().for_each(|g| *g = self.coef[0]);
        dc.response.iter_mut().for_each(|g| *g = self.coef[1]);
        let dr = match r {
            Some(r) => {
                let mut d = Grads64::zeros_like(r);
                d.response.iter_mut().for_each(|g| *g = self.coef[2]);
                d
            }
            None => Grads64::empty(),
        };
        Out64 {
            loss: self.loss,
            metrics: self.metrics,
            d_chosen: dc,
            d_rejected: dr,
        }
    }
}

pub fn orpo64(c: &Branch64, r: &Branch64, lambda: f64, scope: SftScope) -> Result<Out64, String> {
    check_branch("orpo", "chosen", c)?;
    check_branch("orpo", "rejected", r)?;
    Ok(orpo_sums(&BranchSums::of(c), &BranchSums::of(r), lambda, scope)?.into_tokens(c, Some(r)))
}

pub fn sft64(b: &Branch64, all_tokens: bool) -> Result<Out64, String> {
    check_branch("sft", "sequence", b)?;
    Ok(sft_sums(&BranchSums::of(b), all_tokens)?.into_tokens(b, None))
}

#[allow(clippy::too_many_arguments)]
pub fn dpo64(
    c: &Branch64,
    r: &Branch64,
    rc: f64,
    rr: f64,
    beta: f64,
    ls: f64,
    loss_type: DpoLossType,
) -> Result<Out64, String> {
    check_branch("dpo", "chosen", c)?;
    check_branch("dpo", "rejected", r)?;
    let out = dpo_sums(
        &BranchSums::of(c),
        &BranchSums::of(r),
        rc,
        rr,
        beta,
        ls,
        loss_type,
    )?;
    Ok(out.into_tokens(c, Some(r)))
}

pub fn simpo64(c: &Branch64, r: &Branch64, beta: f64, gamma: f64) -> Result<Out64, String> {
    check_branch("simpo", "chosen", c)?;
    check_branch("simpo", "rejected", r)?;
    let out = simpo_sums(&BranchSums::of(c), &BranchSums::of(r), beta, gamma)?;
    Ok(out.into_tokens(c, Some(r)))
}
