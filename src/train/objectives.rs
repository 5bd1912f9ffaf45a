//! Preference / fine-tuning objectives as pure functions of per-token log-probabilities.
//!
//! Why this module exists: the loss maths of ORPO, SFT, DPO and SimPO is where subtle,
//! silent bugs live (mean vs. sum of log-probs, the scope of ORPO's NLL term, unstable
//! `log(1 - exp(x))`, sign errors in hand-derived gradients). Keeping it separate from the
//! model, the tokenizer and the optimiser makes it testable in isolation against
//! straightforward reference formulas, finite differences and worked examples whose
//! numbers were computed independently (TRL's trainers are the oracle for the
//! definitions and the metric names).
//!
//! The model side produces, per branch (chosen / rejected), the per-token `log p(target)`
//! over the response tokens (and, for full-scope NLL, over the prompt tokens too). Every
//! objective reads those values only through their sums and counts per part
//! ([`BranchSums`]), so the `*_sums` functions here take the sums and return the loss, the
//! metrics (with TRL's names) and `d loss / d logp` as one constant per part (chosen prompt,
//! chosen response, rejected response); `train::device_loss` broadcasts the constants over the
//! tokens where the logps live. The per-token form (per-token logps in, a gradient for every
//! token out, a bad token named by its index) is compiled for tests only (`per_token`): the
//! tests below check it against reference formulas and finite differences, and
//! `device_loss`'s tests compare with it.
//!
//! All functions work on ONE example (one preference pair). For a batch mean, average the
//! losses/metrics over the examples and scale each example's gradients by `1 / batch`.
//! Reductions are done in `f64`.
//!
//! Errors are `Result<_, String>`; no function panics on bad input.

/// Log-probabilities above this value are rejected as "not a log-probability".
/// (Small positive values can come out of `log_softmax` rounding and are tolerated.)
pub const LOGP_POSITIVE_TOLERANCE: f64 = 1e-3;

/// ORPO's odds need a mean log-probability strictly below zero. Means above this ceiling
/// (e.g. exactly `0.0`, or tiny positive rounding noise) are clamped to it before the odds
/// computation, and the gradient is evaluated at the clamped point (straight through).
/// The loss and gradient have finite limits as the mean goes to `0`, so this changes
/// the results by a relative amount of order `1e-30`.
pub const ODDS_MEAN_CEILING: f64 = -1e-30;

pub use crate::config::{DpoLossType, SftScope};
use crate::config::{Method, TrainConfig};

/// The training objective and its hyperparameters.
#[derive(Clone, Copy, Debug)]
pub enum Objective {
    Orpo {
        lambda: f64,
        scope: SftScope,
    },
    Sft {
        all_tokens: bool,
    },
    Dpo {
        beta: f64,
        label_smoothing: f64,
        loss_type: DpoLossType,
    },
    Simpo {
        beta: f64,
        gamma: f64,
    },
}

impl Objective {
    pub fn is_preference(&self) -> bool {
        !matches!(self, Objective::Sft { .. })
    }
    /// Whether the prompt tokens' logps enter the loss.
    pub(crate) fn needs_prompt(&self) -> bool {
        matches!(
            self,
            Objective::Orpo {
                scope: SftScope::Full,
                ..
            } | Objective::Sft { all_tokens: true }
        )
    }
}

impl TrainConfig {
    /// The configured method's objective with its hyperparameters.
    pub fn objective(&self) -> Objective {
        match self.method {
            Method::Orpo => Objective::Orpo {
                lambda: self.orpo_lambda,
                scope: self.sft_scope,
            },
            Method::Sft => Objective::Sft {
                all_tokens: self.sft_all_tokens,
            },
            Method::Dpo => Objective::Dpo {
                beta: self.dpo_beta,
                label_smoothing: self.label_smoothing,
                loss_type: self.dpo_loss_type,
            },
            Method::Simpo => Objective::Simpo {
                beta: self.simpo_beta,
                gamma: self.simpo_gamma,
            },
        }
    }
}

/// ORPO metrics. TRL names are produced by [`Metrics::pairs`].
#[derive(Clone, Debug, PartialEq)]
pub struct OrpoMetrics {
    /// `nll + lambda * or_loss`.
    pub loss: f64,
    /// TRL `nll_loss`.
    pub nll_loss: f64,
    /// `L_OR = -log_sigmoid(log_odds)` (short name `or`).
    pub or_loss: f64,
    /// TRL `log_odds_chosen`.
    pub log_odds: f64,
    /// The ORPO weight (TRL's `beta`), used for the `rewards/*` metrics.
    pub lambda: f64,
    /// Mean logp of the chosen response.
    pub lw: f64,
    /// Mean logp of the rejected response.
    pub lr: f64,
}

/// SFT metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct SftMetrics {
    pub loss: f64,
    pub nll: f64,
    /// Number of tokens averaged over.
    pub tokens: usize,
}

/// DPO metrics (every loss type).
#[derive(Clone, Debug, PartialEq)]
pub struct DpoMetrics {
    pub loss: f64,
    pub beta: f64,
    /// Policy logp sums over the responses (means under IPO).
    pub pc: f64,
    pub pr: f64,
    /// Reference logp sums over the responses (means under IPO).
    pub rc: f64,
    pub rr: f64,
    /// Mean policy logps of the responses.
    pub lw: f64,
    pub lr: f64,
}

/// SimPO metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct SimpoMetrics {
    pub loss: f64,
    pub beta: f64,
    pub gamma: f64,
    /// Mean logps of the responses.
    pub lw: f64,
    pub lr: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Metrics {
    Orpo(OrpoMetrics),
    Sft(SftMetrics),
    Dpo(DpoMetrics),
    Simpo(SimpoMetrics),
}

fn indicator(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

impl Metrics {
    /// All metrics as `(name, value)` pairs for JSON logging: TRL's names plus our short ones.
    ///
    /// * ORPO: `loss nll_loss log_odds_ratio log_odds_chosen rewards/chosen rewards/rejected
    ///   rewards/accuracies rewards/margins logps/chosen logps/rejected or accuracy margin lw lr`
    ///   (`margin = lw - lr`, `accuracy = [lw > lr]`).
    /// * SFT: `loss nll tokens`.
    /// * DPO: `loss rewards/chosen rewards/rejected rewards/accuracies rewards/margins
    ///   logps/chosen logps/rejected accuracy margin lw lr` (`logps/*` are SUMS,
    ///   `margin = rewards/margins`, `lw`/`lr` are MEANS; under IPO `logps/*` and the rewards
    ///   are on MEANS, as TRL's).
    /// * SimPO: same names as DPO; `logps/*` are means (= `lw`, `lr`), rewards are
    ///   `beta * lw`, `beta * lr`, and `margin = lw - lr`.
    pub fn pairs(&self) -> Vec<(&'static str, f64)> {
        match self {
            Metrics::Orpo(m) => {
                let rc = m.lambda * m.lw;
                let rr = m.lambda * m.lr;
                vec![
                    ("loss", m.loss),
                    ("nll_loss", m.nll_loss),
                    ("log_odds_ratio", -m.or_loss),
                    ("log_odds_chosen", m.log_odds),
                    ("rewards/chosen", rc),
                    ("rewards/rejected", rr),
                    ("rewards/accuracies", indicator(rc > rr)),
                    ("rewards/margins", m.lambda * (m.lw - m.lr)),
                    ("logps/chosen", m.lw),
                    ("logps/rejected", m.lr),
                    ("or", m.or_loss),
                    ("accuracy", indicator(m.lw > m.lr)),
                    ("margin", m.lw - m.lr),
                    ("lw", m.lw),
                    ("lr", m.lr),
                ]
            }
            Metrics::Sft(m) => vec![
                ("loss", m.loss),
                ("nll", m.nll),
                ("tokens", m.tokens as f64),
            ],
            Metrics::Dpo(m) => {
                let rc = m.beta * (m.pc - m.rc);
                let rr = m.beta * (m.pr - m.rr);
                vec![
                    ("loss", m.loss),
                    ("rewards/chosen", rc),
                    ("rewards/rejected", rr),
                    ("rewards/accuracies", indicator(rc > rr)),
                    ("rewards/margins", rc - rr),
                    ("logps/chosen", m.pc),
                    ("logps/rejected", m.pr),
                    ("accuracy", indicator(rc > rr)),
                    ("margin", rc - rr),
                    ("lw", m.lw),
                    ("lr", m.lr),
                ]
            }
            Metrics::Simpo(m) => {
                let rc = m.beta * m.lw;
                let rr = m.beta * m.lr;
                vec![
                    ("loss", m.loss),
                    ("rewards/chosen", rc),
                    ("rewards/rejected", rr),
                    ("rewards/accuracies", indicator(rc > rr)),
                    ("rewards/margins", rc - rr),
                    ("logps/chosen", m.lw),
                    ("logps/rejected", m.lr),
                    ("accuracy", indicator(m.lw > m.lr)),
                    ("margin", m.lw - m.lr),
                    ("lw", m.lw),
                    ("lr", m.lr),
                ]
            }
        }
    }

    /// Look one metric up by name (any name listed by [`Metrics::pairs`]).
    pub fn get(&self, name: &str) -> Option<f64> {
        self.pairs()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
    }
}

// ---------------------------------------------------------------------------
// Numerics
// ---------------------------------------------------------------------------

/// `log(sigmoid(x))`, stable for all finite `x`.
fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

/// `sigmoid(x)`, stable for all finite `x`.
fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `log(1 - exp(x))` for `x < 0` (Mächler's recipe).
fn log1mexp(x: f64) -> f64 {
    if x > -std::f64::consts::LN_2 {
        (-x.exp_m1()).ln()
    } else {
        (-x.exp()).ln_1p()
    }
}

/// `d/dx log1mexp(x) = -exp(x) / (1 - exp(x)) = -1 / expm1(-x)`.
fn d_log1mexp(x: f64) -> f64 {
    -1.0 / (-x).exp_m1()
}

fn check_param(obj: &str, name: &str, v: f64, ok: bool, want: &str) -> Result<(), String> {
    if v.is_finite() && ok {
        Ok(())
    } else {
        Err(format!("{obj}: {name} = {v} is invalid (want {want})"))
    }
}

/// What every objective reads of one branch: the sums and counts of its prompt and response
/// logps. Each objective is a function of these, so its gradient is one constant per part.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BranchSums {
    pub prompt: f64,
    pub n_prompt: usize,
    pub response: f64,
    pub n_response: usize,
}

impl BranchSums {
    fn mean_response(&self) -> f64 {
        self.response / self.n_response as f64
    }
}

/// An objective evaluated on branch sums: the loss, the metrics, and `d loss / d logp` of one
/// token of each part (`[chosen prompt, chosen response, rejected response]`).
#[derive(Clone, Debug, PartialEq)]
pub struct SumsOut {
    pub loss: f64,
    pub metrics: Metrics,
    pub coef: [f64; 3],
}

impl SumsOut {
    /// `loss_clip` (every objective): an example whose loss is above `clip` contributes `clip`,
    /// a constant, so its gradient is exactly zero: such an example (usually a mislabelled or
    /// degenerate pair, whose gradient would dominate the batch) drops out of the update instead
    /// of being scaled down. At or below the clip nothing changes. The metrics keep the
    /// unclipped loss. Returns whether the loss was clipped.
    pub fn clip(&mut self, clip: Option<f64>) -> bool {
        match clip {
            Some(c) if self.loss > c => {
                self.loss = c;
                self.coef = [0.0; 3];
                true
            }
            _ => false,
        }
    }

    /// The example weight (a preference row's `weight`): loss and gradient times `w`; the
    /// metrics stay unweighted.
    pub fn weighted(mut self, w: f64) -> SumsOut {
        self.loss *= w;
        self.coef = self.coef.map(|g| g * w);
        self
    }
}

fn check_response(obj: &str, branch: &str, s: &BranchSums) -> Result<(), String> {
    if s.n_response == 0 {
        return Err(format!(
            "{obj}: {branch} response is empty (need at least one response token)"
        ));
    }
    Ok(())
}

/// ORPO (Hong et al. 2024, TRL `ORPOTrainer`) on branch sums: `loss = nll + lambda * L_OR`
/// with `L_OR = -log_sigmoid(log_odds)`, `log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))`,
/// `lw`/`lr` the MEAN response logps. `scope` selects the NLL term (see [`SftScope`]). The
/// prompt sum of `r` is not read.
pub fn orpo_sums(
    c: &BranchSums,
    r: &BranchSums,
    lambda: f64,
    scope: SftScope,
) -> Result<SumsOut, String> {
    check_response("orpo", "chosen", c)?;
    check_response("orpo", "rejected", r)?;
    check_param("orpo", "lambda", lambda, lambda >= 0.0, "finite, >= 0")?;

    let nc = c.n_response as f64;
    let nr = r.n_response as f64;
    let lw = c.mean_response();
    let lr = r.mean_response();
    // Odds need means strictly below zero (see ODDS_MEAN_CEILING).
    let lw_o = lw.min(ODDS_MEAN_CEILING);
    let lr_o = lr.min(ODDS_MEAN_CEILING);

    let log_odds = (lw_o - lr_o) - (log1mexp(lw_o) - log1mexp(lr_o));
    let or_loss = -log_sigmoid(log_odds);

    let (nll, nll_tok_grad_prompt, nll_tok_grad_resp) = match scope {
        SftScope::Full => {
            let n = (c.n_prompt + c.n_response) as f64;
            (-(c.prompt + c.response) / n, -1.0 / n, -1.0 / n)
        }
        SftScope::Response => (-lw, 0.0, -1.0 / nc),
    };
    let loss = nll + lambda * or_loss;

    // d L_OR / d log_odds = -(1 - sigmoid(log_odds)) = -sigmoid(-log_odds).
    let d_or = -sigmoid(-log_odds);
    // d log_odds / d lw = 1 - log1mexp'(lw);  d log_odds / d lr = -1 + log1mexp'(lr).
    let d_lw = lambda * d_or * (1.0 - d_log1mexp(lw_o));
    let d_lr = lambda * d_or * (-1.0 + d_log1mexp(lr_o));

    Ok(SumsOut {
        loss,
        metrics: Metrics::Orpo(OrpoMetrics {
            loss,
            nll_loss: nll,
            or_loss,
            log_odds,
            lambda,
            lw,
            lr,
        }),
        coef: [
            nll_tok_grad_prompt,
            d_lw / nc + nll_tok_grad_resp,
            d_lr / nr,
        ],
    })
}

/// SFT on the sums of one branch: token-mean NLL over the response, or over prompt + response
/// when `all_tokens`. `coef[2]` (the rejected response) is 0.
pub fn sft_sums(b: &BranchSums, all_tokens: bool) -> Result<SumsOut, String> {
    check_response("sft", "sequence", b)?;
    let (nll, tokens, coef) = if all_tokens {
        let n = b.n_prompt + b.n_response;
        let g = -1.0 / n as f64;
        (-(b.prompt + b.response) / n as f64, n, [g, g, 0.0])
    } else {
        let n = b.n_response;
        (-b.mean_response(), n, [0.0, -1.0 / n as f64, 0.0])
    };
    Ok(SumsOut {
        loss: nll,
        metrics: Metrics::Sft(SftMetrics {
            loss: nll,
            nll,
            tokens,
        }),
        coef,
    })
}

/// DPO on branch sums (TRL `DPOTrainer`), with its `loss_type` ([`DpoLossType`]). With the
/// policy response logps `pc`/`pr` and the reference ones `rc`/`rr` (constants), the margin is
/// `z = (pc - rc) - (pr - rr)` (TRL's `logits`) and
///
/// * sigmoid (default), with cDPO label smoothing `ls`:
///   `loss = -(1 - ls) * log_sigmoid(beta z) - ls * log_sigmoid(-beta z)`;
/// * robust (Chowdhury et al. 2024), `ls < 0.5`:
///   `loss = (-(1 - ls) * log_sigmoid(beta z) + ls * log_sigmoid(-beta z)) / (1 - 2 ls)`;
/// * hinge (SLiC): `loss = relu(1 - beta z)` (gradient 0 where `beta z >= 1`, as torch's relu);
/// * IPO (Azar et al. 2023, eqn 17): `loss = (z - 1 / (2 beta))^2`; here, as in TRL
///   (`concatenated_forward` divides every logp sum by its token count when `"ipo" in
///   loss_type`), `pc`, `pr`, `rc`, `rr` are token MEANS of the responses (the reference has
///   the policy's tokens, so its counts are the policy's).
///
/// `ls` must be 0 for hinge and IPO (TRL ignores it there; a set value is refused rather than
/// dropped). The metrics hold the logps the margin was computed on: sums, means under IPO (TRL's
/// `logps/*` and `rewards/*` under IPO are on means too).
#[allow(clippy::too_many_arguments)]
pub fn dpo_sums(
    c: &BranchSums,
    r: &BranchSums,
    rc: f64,
    rr: f64,
    beta: f64,
    ls: f64,
    loss_type: DpoLossType,
) -> Result<SumsOut, String> {
    check_response("dpo", "chosen", c)?;
    check_response("dpo", "rejected", r)?;
    check_param("dpo", "ref_chosen_sum", rc, true, "finite")?;
    check_param("dpo", "ref_rejected_sum", rr, true, "finite")?;
    check_param("dpo", "beta", beta, beta > 0.0, "finite, > 0")?;
    match loss_type {
        DpoLossType::Sigmoid => check_param(
            "dpo",
            "label_smoothing",
            ls,
            (0.0..=1.0).contains(&ls),
            "in [0, 1]",
        )?,
        DpoLossType::Robust => check_param(
            "dpo robust",
            "label_smoothing",
            ls,
            (0.0..0.5).contains(&ls),
            "in [0, 0.5)",
        )?,
        DpoLossType::Ipo | DpoLossType::Hinge => check_param(
            "dpo ipo/hinge",
            "label_smoothing",
            ls,
            ls == 0.0,
            "0: label smoothing applies to sigmoid and robust only",
        )?,
    }

    let (nc, nr) = (c.n_response as f64, r.n_response as f64);
    // What one token's logp moves the policy logps by: 1 on sums, 1/n on means (IPO).
    let (pc, pr, rc, rr, tc, tr) = match loss_type {
        DpoLossType::Ipo => (
            c.response / nc,
            r.response / nr,
            rc / nc,
            rr / nr,
            1.0 / nc,
            1.0 / nr,
        ),
        _ => (c.response, r.response, rc, rr, 1.0, 1.0),
    };
    let z = (pc - rc) - (pr - rr);
    let u = beta * z;
    // (loss, d loss / d z)
    let (loss, dz) = match loss_type {
        // d/du log_sigmoid(u) = sigmoid(-u); d/du log_sigmoid(-u) = -sigmoid(u).
        DpoLossType::Sigmoid => (
            -(1.0 - ls) * log_sigmoid(u) - ls * log_sigmoid(-u),
            beta * (-(1.0 - ls) * sigmoid(-u) + ls * sigmoid(u)),
        ),
        DpoLossType::Robust => {
            let k = 1.0 - 2.0 * ls;
            (
                (-(1.0 - ls) * log_sigmoid(u) + ls * log_sigmoid(-u)) / k,
                beta * (-(1.0 - ls) * sigmoid(-u) - ls * sigmoid(u)) / k,
            )
        }
        DpoLossType::Hinge => {
            let h = 1.0 - u;
            if h > 0.0 {
                (h, -beta)
            } else {
                (0.0, 0.0)
            }
        }
        DpoLossType::Ipo => {
            let d = z - 1.0 / (2.0 * beta);
            (d * d, 2.0 * d)
        }
    };

    Ok(SumsOut {
        loss,
        metrics: Metrics::Dpo(DpoMetrics {
            loss,
            beta,
            pc,
            pr,
            rc,
            rr,
            lw: c.mean_response(),
            lr: r.mean_response(),
        }),
        coef: [0.0, dz * tc, -dz * tr],
    })
}

/// SimPO (Meng et al. 2024; TRL `CPOTrainer` with `loss_type="simpo"`, `cpo_alpha=0`) on
/// branch sums: `z = beta * (lw - lr) - gamma`, `loss = -log_sigmoid(z)`, `lw`/`lr` MEAN
/// response logps.
pub fn simpo_sums(
    c: &BranchSums,
    r: &BranchSums,
    beta: f64,
    gamma: f64,
) -> Result<SumsOut, String> {
    check_response("simpo", "chosen", c)?;
    check_response("simpo", "rejected", r)?;
    check_param("simpo", "beta", beta, beta > 0.0, "finite, > 0")?;
    check_param("simpo", "gamma", gamma, true, "finite")?;

    let lw = c.mean_response();
    let lr = r.mean_response();
    let z = beta * (lw - lr) - gamma;
    let loss = -log_sigmoid(z);
    let dz = -sigmoid(-z);

    Ok(SumsOut {
        loss,
        metrics: Metrics::Simpo(SimpoMetrics {
            loss,
            beta,
            gamma,
            lw,
            lr,
        }),
        coef: [
            0.0,
            beta * dz / c.n_response as f64,
            -beta * dz / r.n_response as f64,
        ],
    })
}

/// The per-token form of the objectives (tests only).
#[cfg(test)]
pub(crate) mod per_token;

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::per_token::*;
    use super::*;

    /// SplitMix64: tiny deterministic PRNG.
    struct Rng(u64);
    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn unif(&mut self) -> f64 {
            (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
        }
        /// A logp in [-8, -0.01], rounded to f32 (so f32 and f64 paths see the same values).
        fn logp(&mut self) -> f32 {
            (-8.0 + (8.0 - 0.01) * self.unif()) as f32
        }
        fn vec(&mut self, lo: usize, hi: usize) -> Vec<f32> {
            let n = lo + (self.next_u64() % (hi - lo + 1) as u64) as usize;
            (0..n).map(|_| self.logp()).collect()
        }
    }

    fn to64(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| x as f64).collect()
    }

    fn b64(p: &[f32], r: &[f32]) -> Branch64 {
        Branch64 {
            prompt: to64(p),
            response: to64(r),
        }
    }

    fn close(a: f64, b: f64, rel: f64, abs: f64) -> bool {
        (a - b).abs() <= rel * a.abs().max(b.abs()) + abs
    }

    fn assert_close(what: &str, got: f64, want: f64, rel: f64, abs: f64) {
        assert!(
            close(got, want, rel, abs),
            "{what}: got {got:.17e}, want {want:.17e} (rel {rel:e}, abs {abs:e})"
        );
    }

    fn metric(out: &ObjectiveOut, name: &str) -> f64 {
        out.metrics
            .get(name)
            .unwrap_or_else(|| panic!("missing metric {name}"))
    }

    // ---- naive f64 reference implementations (textbook formulas, no stabilisation) ----

    fn naive_mean(v: &[f64]) -> f64 {
        let mut s = 0.0;
        for x in v {
            s += x;
        }
        s / v.len() as f64
    }
    fn naive_logsig(x: f64) -> f64 {
        (1.0 / (1.0 + (-x).exp())).ln()
    }

    /// Returns (loss, nll, log_odds, ratio).
    fn ref_orpo(cp: &[f64], cr: &[f64], rr: &[f64], lambda: f64, full: bool) -> [f64; 4] {
        let lw = naive_mean(cr);
        let lr = naive_mean(rr);
        let odds_w = lw.exp() / (1.0 - lw.exp());
        let odds_r = lr.exp() / (1.0 - lr.exp());
        let log_odds = (odds_w / odds_r).ln();
        let ratio = naive_logsig(log_odds);
        let nll = if full {
            let all: Vec<f64> = cp.iter().chain(cr.iter()).copied().collect();
            -naive_mean(&all)
        } else {
            -lw
        };
        [nll - lambda * ratio, nll, log_odds, ratio]
    }

    fn ref_dpo(cr: &[f64], rr: &[f64], refc: f64, refr: f64, beta: f64, ls: f64) -> f64 {
        let pc: f64 = cr.iter().sum();
        let pr: f64 = rr.iter().sum();
        let z = beta * ((pc - refc) - (pr - refr));
        -(1.0 - ls) * naive_logsig(z) - ls * naive_logsig(-z)
    }

    fn ref_simpo(cr: &[f64], rr: &[f64], beta: f64, gamma: f64) -> f64 {
        -naive_logsig(beta * (naive_mean(cr) - naive_mean(rr)) - gamma)
    }

    // ---- 1. module vs naive reference on random inputs ----

    #[test]
    fn orpo_matches_naive_reference() {
        let mut rng = Rng(1);
        for case in 0..300 {
            let cp = rng.vec(0, 10);
            let cr = rng.vec(1, 12);
            let rp = rng.vec(0, 10);
            let rr = rng.vec(1, 12);
            let lambda = [0.0, 0.1, 0.5, 1.0][case % 4];
            for (scope, full) in [(SftScope::Full, true), (SftScope::Response, false)] {
                let out = orpo(
                    BranchLogps::new(&cp, &cr),
                    BranchLogps::new(&rp, &rr),
                    lambda,
                    scope,
                )
                .unwrap();
                let [loss, nll, lo, ratio] =
                    ref_orpo(&to64(&cp), &to64(&cr), &to64(&rr), lambda, full);
                // Naive vs stable formulas differ only by rounding: 1e-9 relative is generous.
                assert_close("loss", out.loss, loss, 1e-9, 1e-12);
                assert_close("loss metric", metric(&out, "loss"), loss, 1e-9, 1e-12);
                assert_close("nll_loss", metric(&out, "nll_loss"), nll, 1e-9, 1e-12);
                assert_close(
                    "log_odds_chosen",
                    metric(&out, "log_odds_chosen"),
                    lo,
                    1e-9,
                    1e-12,
                );
                assert_close(
                    "log_odds_ratio",
                    metric(&out, "log_odds_ratio"),
                    ratio,
                    1e-9,
                    1e-12,
                );
                assert_close("or", metric(&out, "or"), -ratio, 1e-9, 1e-12);
                let lw = naive_mean(&to64(&cr));
                let lr = naive_mean(&to64(&rr));
                assert_close("lw", metric(&out, "logps/chosen"), lw, 1e-12, 0.0);
                assert_close("lr", metric(&out, "logps/rejected"), lr, 1e-12, 0.0);
                assert_close(
                    "rw/c",
                    metric(&out, "rewards/chosen"),
                    lambda * lw,
                    1e-12,
                    0.0,
                );
                assert_close(
                    "rw/r",
                    metric(&out, "rewards/rejected"),
                    lambda * lr,
                    1e-12,
                    0.0,
                );
                assert_close(
                    "rw/m",
                    metric(&out, "rewards/margins"),
                    lambda * (lw - lr),
                    1e-9,
                    1e-12,
                );
                assert_close("margin", metric(&out, "margin"), lw - lr, 1e-12, 1e-15);
                assert_eq!(metric(&out, "accuracy"), indicator(lw > lr));
                assert_eq!(
                    metric(&out, "rewards/accuracies"),
                    indicator(lambda * lw > lambda * lr)
                );
                // Gradient shapes mirror the inputs.
                assert_eq!(out.d_chosen.prompt.len(), cp.len());
                assert_eq!(out.d_chosen.response.len(), cr.len());
                assert_eq!(out.d_rejected.prompt.len(), rp.len());
                assert_eq!(out.d_rejected.response.len(), rr.len());
                assert!(out.d_rejected.prompt.iter().all(|&g| g == 0.0));
                if !full {
                    assert!(out.d_chosen.prompt.iter().all(|&g| g == 0.0));
                }
            }
        }
    }

    #[test]
    fn sft_dpo_simpo_match_naive_reference() {
        let mut rng = Rng(2);
        for case in 0..300 {
            let cp = rng.vec(0, 10);
            let cr = rng.vec(1, 12);
            let rp = rng.vec(0, 10);
            let rr = rng.vec(1, 12);
            let (c64, r64) = (to64(&cr), to64(&rr));

            let s = sft(BranchLogps::new(&cp, &cr), false).unwrap();
            assert_close("sft", s.loss, -naive_mean(&c64), 1e-12, 0.0);
            assert_eq!(metric(&s, "tokens"), cr.len() as f64);
            let s = sft(BranchLogps::new(&cp, &cr), true).unwrap();
            let all: Vec<f64> = to64(&cp).into_iter().chain(c64.iter().copied()).collect();
            assert_close("sft all", s.loss, -naive_mean(&all), 1e-12, 0.0);
            assert_close("sft nll", metric(&s, "nll"), -naive_mean(&all), 1e-12, 0.0);
            assert_eq!(metric(&s, "tokens"), all.len() as f64);
            assert!(s.d_rejected.prompt.is_empty() && s.d_rejected.response.is_empty());

            let beta = [0.05, 0.1, 0.5][case % 3];
            let ls = [0.0, 0.1, 0.3][case % 3];
            let refc = naive_mean(&c64) * c64.len() as f64 + 3.0 * (rng.unif() - 0.5);
            let refr = naive_mean(&r64) * r64.len() as f64 + 3.0 * (rng.unif() - 0.5);
            let d = dpo(
                BranchLogps::new(&cp, &cr),
                BranchLogps::new(&rp, &rr),
                refc,
                refr,
                beta,
                ls,
                DpoLossType::Sigmoid,
            )
            .unwrap();
            assert_close(
                "dpo",
                d.loss,
                ref_dpo(&c64, &r64, refc, refr, beta, ls),
                1e-9,
                1e-12,
            );
            let pc: f64 = c64.iter().sum();
            let pr: f64 = r64.iter().sum();
            assert_close(
                "dpo rw/c",
                metric(&d, "rewards/chosen"),
                beta * (pc - refc),
                1e-9,
                1e-12,
            );
            assert_close(
                "dpo rw/r",
                metric(&d, "rewards/rejected"),
                beta * (pr - refr),
                1e-9,
                1e-12,
            );
            let m = beta * ((pc - refc) - (pr - refr));
            assert_close("dpo margins", metric(&d, "rewards/margins"), m, 1e-9, 1e-12);
            assert_close("dpo margin", metric(&d, "margin"), m, 1e-9, 1e-12);
            assert_eq!(metric(&d, "rewards/accuracies"), indicator(m > 0.0));
            assert_close(
                "dpo logps/chosen",
                metric(&d, "logps/chosen"),
                pc,
                1e-12,
                0.0,
            );
            assert_close(
                "dpo logps/rejected",
                metric(&d, "logps/rejected"),
                pr,
                1e-12,
                0.0,
            );
            assert_close("dpo lw", metric(&d, "lw"), naive_mean(&c64), 1e-12, 0.0);
            assert_close("dpo lr", metric(&d, "lr"), naive_mean(&r64), 1e-12, 0.0);

            let (sb, sg) = ([0.5, 2.0, 10.0][case % 3], [0.0, 0.5, 1.6][case % 3]);
            let p = simpo(
                BranchLogps::new(&cp, &cr),
                BranchLogps::new(&rp, &rr),
                sb,
                sg,
            )
            .unwrap();
            assert_close("simpo", p.loss, ref_simpo(&c64, &r64, sb, sg), 1e-9, 1e-12);
            assert_close(
                "simpo rw/c",
                metric(&p, "rewards/chosen"),
                sb * naive_mean(&c64),
                1e-12,
                0.0,
            );
            assert_close(
                "simpo margin",
                metric(&p, "margin"),
                naive_mean(&c64) - naive_mean(&r64),
                1e-12,
                1e-15,
            );
        }
    }

    #[test]
    fn f32_api_grads_equal_f64_core_grads() {
        let mut rng = Rng(3);
        let (cp, cr, rp, rr) = (rng.vec(2, 5), rng.vec(2, 5), rng.vec(2, 5), rng.vec(2, 5));
        let out = orpo(
            BranchLogps::new(&cp, &cr),
            BranchLogps::new(&rp, &rr),
            0.2,
            SftScope::Full,
        )
        .unwrap();
        let core = orpo64(&b64(&cp, &cr), &b64(&rp, &rr), 0.2, SftScope::Full).unwrap();
        assert_eq!(out.d_chosen, core.d_chosen.to_f32());
        assert_eq!(out.d_rejected, core.d_rejected.to_f32());
        assert_eq!(out.loss, core.loss);
    }

    // ---- 2. finite differences on the f64 core ----

    /// Central differences on every input logp. Step per branch:
    /// `h = 1e-4 * min(1, |mean response logp|)` so that near-zero means (where log1mexp is
    /// strongly curved) still have truncation error O(h^2 f''') << 1e-6 relative.
    /// Tolerance: `|fd - analytic| <= 1e-6 * max(|fd|, |analytic|) + 1e-9`; the absolute
    /// 1e-9 covers the rounding noise of the difference quotient (~eps * |loss| / h) for
    /// gradients that are themselves tiny.
    fn fd_check<F>(name: &str, c: &Branch64, r: &Branch64, f: F)
    where
        F: Fn(&Branch64, &Branch64) -> Result<Out64, String>,
    {
        let out = f(c, r).unwrap();
        let mut checked = 0usize;
        for which in 0..4 {
            let (src, analytic) = match which {
                0 => (c.prompt.len(), &out.d_chosen.prompt),
                1 => (c.response.len(), &out.d_chosen.response),
                2 => (r.prompt.len(), &out.d_rejected.prompt),
                _ => (r.response.len(), &out.d_rejected.response),
            };
            if analytic.is_empty() && src > 0 {
                // SFT has no rejected branch: perturbing it must not matter; nothing to compare.
                continue;
            }
            assert_eq!(analytic.len(), src, "{name}: grad shape");
            let base = if which < 2 { c } else { r };
            let h = 1e-4 * naive_mean(&base.response).abs().min(1.0);
            for (i, &an) in analytic.iter().enumerate() {
                let eval = |delta: f64| {
                    let (mut c2, mut r2) = (c.clone(), r.clone());
                    let v = match which {
                        0 => &mut c2.prompt[i],
                        1 => &mut c2.response[i],
                        2 => &mut r2.prompt[i],
                        _ => &mut r2.response[i],
                    };
                    *v += delta;
                    f(&c2, &r2).unwrap().loss
                };
                let fd = (eval(h) - eval(-h)) / (2.0 * h);
                assert!(
                    close(fd, an, 1e-6, 1e-9),
                    "{name}: part {which} token {i}: fd {fd:.12e} vs analytic {an:.12e}"
                );
                checked += 1;
            }
        }
        assert!(checked > 0, "{name}: nothing checked");
    }

    fn rand_branch(rng: &mut Rng, with_prompt: bool) -> Branch64 {
        let p = if with_prompt {
            rng.vec(1, 6)
        } else {
            Vec::new()
        };
        let r = rng.vec(1, 8);
        b64(&p, &r)
    }

    #[test]
    fn finite_differences_all_objectives() {
        let mut rng = Rng(4);
        for case in 0..60 {
            let c = rand_branch(&mut rng, case % 3 != 0);
            let r = rand_branch(&mut rng, case % 2 == 0);
            for lambda in [0.0, 0.1, 1.0] {
                fd_check("orpo full", &c, &r, |c, r| {
                    orpo64(c, r, lambda, SftScope::Full)
                });
                fd_check("orpo resp", &c, &r, |c, r| {
                    orpo64(c, r, lambda, SftScope::Response)
                });
            }
            fd_check("sft", &c, &r, |c, _| sft64(c, false));
            fd_check("sft all", &c, &r, |c, _| sft64(c, true));
            let refc = c.response.iter().sum::<f64>() + 2.0 * (rng.unif() - 0.5);
            let refr = r.response.iter().sum::<f64>() + 2.0 * (rng.unif() - 0.5);
            for (beta, ls) in [(0.1, 0.0), (0.5, 0.2), (0.05, 0.5)] {
                fd_check("dpo", &c, &r, |c, r| {
                    dpo64(c, r, refc, refr, beta, ls, DpoLossType::Sigmoid)
                });
            }
            for (beta, gamma) in [(2.0, 0.5), (0.5, 0.0), (10.0, 3.0)] {
                fd_check("simpo", &c, &r, |c, r| simpo64(c, r, beta, gamma));
            }
        }
        // The other DPO loss types, and the loss clip (placed well away from the loss, so
        // that no difference quotient straddles it), on the same random branches.
        let mut rng = Rng(14);
        for case in 0..60 {
            let c = rand_branch(&mut rng, case % 3 != 0);
            let r = rand_branch(&mut rng, case % 2 == 0);
            let refc = c.response.iter().sum::<f64>() + 4.0 * (rng.unif() - 0.5);
            let refr = r.response.iter().sum::<f64>() + 4.0 * (rng.unif() - 0.5);
            for (beta, ls, t) in [
                (0.1, 0.0, DpoLossType::Ipo),
                (0.5, 0.0, DpoLossType::Ipo),
                (2.0, 0.0, DpoLossType::Ipo),
                (0.1, 0.0, DpoLossType::Hinge),
                (0.5, 0.0, DpoLossType::Hinge),
                (0.1, 0.0, DpoLossType::Robust),
                (0.5, 0.2, DpoLossType::Robust),
                (0.05, 0.45, DpoLossType::Robust),
            ] {
                fd_check(&format!("dpo {t:?}"), &c, &r, |c, r| {
                    dpo64(c, r, refc, refr, beta, ls, t)
                });
            }
            let loss = orpo64(&c, &r, 0.5, SftScope::Full).unwrap().loss;
            for clip in [loss * 0.5, loss * 2.0] {
                fd_check("orpo clipped", &c, &r, |c, r| {
                    let mut out = orpo64(c, r, 0.5, SftScope::Full)?;
                    let mut s = SumsOut {
                        loss: out.loss,
                        metrics: out.metrics.clone(),
                        coef: [
                            out.d_chosen.prompt.first().copied().unwrap_or(0.0),
                            out.d_chosen.response[0],
                            out.d_rejected.response[0],
                        ],
                    };
                    let clipped = s.clip(Some(clip));
                    assert_eq!(clipped, out.loss > clip);
                    out.loss = s.loss;
                    let scale = |g: &mut Vec<f64>, k: f64| g.iter_mut().for_each(|x| *x = k);
                    scale(&mut out.d_chosen.prompt, s.coef[0]);
                    scale(&mut out.d_chosen.response, s.coef[1]);
                    scale(&mut out.d_rejected.response, s.coef[2]);
                    Ok(out)
                });
            }
        }
        // Edge-ish points where log1mexp is strongly curved (means close to 0) and far out.
        for (cw, rw) in [
            (-0.01, -0.02),
            (-0.02, -0.01),
            (-1e-3, -30.0),
            (-30.0, -1e-3),
            (-0.69, -0.70),
        ] {
            let c = Branch64 {
                prompt: vec![-1.0, -2.0],
                response: vec![cw, cw * 0.5, cw * 1.5],
            };
            let r = Branch64 {
                prompt: vec![],
                response: vec![rw, rw],
            };
            fd_check("orpo edge", &c, &r, |c, r| {
                orpo64(c, r, 0.5, SftScope::Full)
            });
        }
    }

    // ---- 3. worked examples (expected numbers computed independently in python3) ----

    /// Chosen response [-0.25, -0.75] (lw = -0.5), rejected [-1.0, -2.0] (lr = -1.5),
    /// lambda = 0.1.
    ///   log_odds = (lw - lr) - (log1p(-exp(lw)) - log1p(-exp(lr)))
    ///            = 1.0 - (log(1 - 0.60653066) - log(1 - 0.22313016))
    ///            = 1.0 - (-0.93275 - (-0.25248)) = 1.68026967...
    ///   ratio    = logsigmoid(1.68026967) = -0.17085921...; L_OR = 0.17085921...
    ///   response scope: nll = 0.5, loss = 0.5 + 0.1 * 0.17085921 = 0.51708592...
    ///   full scope with prompt [-2, -1, -3]: nll = (2+1+3+0.25+0.75)/5 = 1.4,
    ///   loss = 1.41708592...
    /// Python (math module, logsigmoid(x) = -log1p(exp(-x)) for x >= 0, sig = 1/(1+exp(-x))):
    ///   lo = (lw-lr)-(math.log1p(-math.exp(lw))-math.log1p(-math.exp(lr)))   -> 1.6802696706417346
    ///   -math.log1p(math.exp(-lo))                                             -> -0.1708592171464785
    ///   0.5 + 0.1*0.1708592171464785                                           -> 0.5170859217146478
    ///   1.4 + 0.1*0.1708592171464785                                           -> 1.4170859217146479
    ///   dlw = 0.1*(-sig(-lo))*(1+1/math.expm1(-lw)); dlw/2 - 1/2               -> -0.5199583229578797
    ///   dlw/2 - 1/5                                                             -> -0.21995832295787973
    ///   dlr = 0.1*(-sig(-lo))*(-1-1/math.expm1(-lr)); dlr/2                    -> 0.010108499216521964
    #[test]
    fn orpo_worked_example_matches_trl_arithmetic() {
        let cr = [-0.25f32, -0.75];
        let rr = [-1.0f32, -2.0];
        let cp = [-2.0f32, -1.0, -3.0];
        let resp = orpo(
            BranchLogps::new(&cp, &cr),
            BranchLogps::response_only(&rr),
            0.1,
            SftScope::Response,
        )
        .unwrap();
        assert_close("loss", resp.loss, 0.5170859217146478, 1e-13, 0.0);
        assert_close("nll", metric(&resp, "nll_loss"), 0.5, 1e-15, 0.0);
        assert_close(
            "log_odds",
            metric(&resp, "log_odds_chosen"),
            1.6802696706417346,
            1e-13,
            0.0,
        );
        assert_close(
            "ratio",
            metric(&resp, "log_odds_ratio"),
            -0.1708592171464785,
            1e-13,
            0.0,
        );
        assert_close("or", metric(&resp, "or"), 0.1708592171464785, 1e-13, 0.0);
        assert_close("rw/c", metric(&resp, "rewards/chosen"), -0.05, 1e-13, 0.0);
        assert_close("rw/r", metric(&resp, "rewards/rejected"), -0.15, 1e-13, 0.0);
        assert_close("rw/m", metric(&resp, "rewards/margins"), 0.1, 1e-13, 0.0);
        assert_eq!(metric(&resp, "rewards/accuracies"), 1.0);
        assert_eq!(metric(&resp, "accuracy"), 1.0);
        assert_close("margin", metric(&resp, "margin"), 1.0, 1e-15, 0.0);
        assert_eq!(resp.d_chosen.prompt, vec![0.0f32; 3]);
        // f32 gradients: compare at f32 precision (relative 1e-6).
        for &g in &resp.d_chosen.response {
            assert_close("gc", g as f64, -0.5199583229578797, 1e-6, 0.0);
        }
        for &g in &resp.d_rejected.response {
            assert_close("gr", g as f64, 0.010108499216521964, 1e-6, 0.0);
        }

        let full = orpo(
            BranchLogps::new(&cp, &cr),
            BranchLogps::response_only(&rr),
            0.1,
            SftScope::Full,
        )
        .unwrap();
        assert_close("full loss", full.loss, 1.4170859217146479, 1e-13, 0.0);
        assert_close("full nll", metric(&full, "nll_loss"), 1.4, 1e-14, 0.0);
        for &g in &full.d_chosen.prompt {
            assert_close("full gp", g as f64, -0.2, 1e-6, 0.0);
        }
        for &g in &full.d_chosen.response {
            assert_close("full gc", g as f64, -0.21995832295787973, 1e-6, 0.0);
        }
        for &g in &full.d_rejected.response {
            assert_close("full gr", g as f64, 0.010108499216521964, 1e-6, 0.0);
        }
    }

    /// DPO: chosen sum -1, rejected sum -3, ref sums -1.5 / -2.5, beta 0.1, ls 0.1:
    ///   z = 0.1 * ((-1 + 1.5) - (-3 + 2.5)) = 0.1
    ///   python: -(0.9)*ls(0.1) - 0.1*ls(-0.1)                  -> 0.6543966600735709
    ///           0.1*(-(0.9)*sig(-0.1) + 0.1*sig(0.1))           -> -0.037502081252106
    /// SimPO: lw -0.5, lr -1.5, beta 2, gamma 0.5: z = 2*1 - 0.5 = 1.5
    ///   python: -ls(1.5)                                         -> 0.2014132779827524
    ///           2.0*(-sig(-1.5))/2                               -> -0.18242552380635635
    #[test]
    fn dpo_and_simpo_worked_examples() {
        let cr = [-0.25f32, -0.75];
        let rr = [-1.0f32, -2.0];
        let d = dpo(
            BranchLogps::response_only(&cr),
            BranchLogps::response_only(&rr),
            -1.5,
            -2.5,
            0.1,
            0.1,
            DpoLossType::Sigmoid,
        )
        .unwrap();
        assert_close("dpo loss", d.loss, 0.6543966600735709, 1e-13, 0.0);
        assert_close("dpo margin", metric(&d, "rewards/margins"), 0.1, 1e-13, 0.0);
        assert_close("dpo rw/c", metric(&d, "rewards/chosen"), 0.05, 1e-13, 0.0);
        assert_close(
            "dpo rw/r",
            metric(&d, "rewards/rejected"),
            -0.05,
            1e-13,
            0.0,
        );
        assert_eq!(metric(&d, "rewards/accuracies"), 1.0);
        for &g in &d.d_chosen.response {
            assert_close("dpo gc", g as f64, -0.037502081252106, 1e-6, 0.0);
        }
        for &g in &d.d_rejected.response {
            assert_close("dpo gr", g as f64, 0.037502081252106, 1e-6, 0.0);
        }

        let s = simpo(
            BranchLogps::response_only(&cr),
            BranchLogps::response_only(&rr),
            2.0,
            0.5,
        )
        .unwrap();
        assert_close("simpo loss", s.loss, 0.2014132779827524, 1e-13, 0.0);
        for &g in &s.d_chosen.response {
            assert_close("simpo gc", g as f64, -0.18242552380635635, 1e-6, 0.0);
        }
        for &g in &s.d_rejected.response {
            assert_close("simpo gr", g as f64, 0.18242552380635635, 1e-6, 0.0);
        }
    }

    /// TRL's `dpo_loss` for `loss_type` in sigmoid / robust / hinge / ipo, written as TRL writes
    /// it (torch's `F.logsigmoid`, `torch.relu`), on the logps TRL feeds it: the response SUMS,
    /// or for IPO the sums divided by the token counts (`concatenated_forward`:
    /// `if "ipo" in self.loss_type: all_logps = all_logps / loss_mask.sum(-1)`).
    fn trl_dpo_loss(
        (pc, nc, pr, nr, rc, rr): (f64, f64, f64, f64, f64, f64),
        beta: f64,
        label_smoothing: f64,
        loss_type: &str,
    ) -> f64 {
        let logsigmoid = naive_logsig;
        let (chosen, rejected, ref_chosen, ref_rejected) = if loss_type == "ipo" {
            (pc / nc, pr / nr, rc / nc, rr / nr)
        } else {
            (pc, pr, rc, rr)
        };
        let logits = (chosen - rejected) - (ref_chosen - ref_rejected);
        match loss_type {
            "sigmoid" => {
                -logsigmoid(beta * logits) * (1.0 - label_smoothing)
                    - logsigmoid(-beta * logits) * label_smoothing
            }
            "robust" => {
                (-logsigmoid(beta * logits) * (1.0 - label_smoothing)
                    + logsigmoid(-beta * logits) * label_smoothing)
                    / (1.0 - 2.0 * label_smoothing)
            }
            "hinge" => (1.0 - beta * logits).max(0.0),
            "ipo" => (logits - 1.0 / (2.0 * beta)).powi(2),
            _ => unreachable!(),
        }
    }

    #[test]
    fn dpo_loss_types_match_trl_formulas() {
        // (policy chosen sum, its tokens, policy rejected sum, its tokens, ref sums)
        let cases = [
            (-10.0, 4.0, -14.0, 6.0, -11.0, -13.0),
            (-3.5, 2.0, -2.0, 1.0, -3.0, -2.5),
            (-40.0, 20.0, -80.0, 25.0, -45.0, -70.0),
            (-1.0, 1.0, -1.0, 1.0, -1.0, -1.0),
        ];
        for &(pc, nc, pr, nr, rc, rr) in &cases {
            let c = BranchSums {
                response: pc,
                n_response: nc as usize,
                ..Default::default()
            };
            let r = BranchSums {
                response: pr,
                n_response: nr as usize,
                ..Default::default()
            };
            for (t, name, ls) in [
                (DpoLossType::Sigmoid, "sigmoid", 0.0),
                (DpoLossType::Sigmoid, "sigmoid", 0.2),
                (DpoLossType::Robust, "robust", 0.0),
                (DpoLossType::Robust, "robust", 0.1),
                (DpoLossType::Robust, "robust", 0.4),
                (DpoLossType::Hinge, "hinge", 0.0),
                (DpoLossType::Ipo, "ipo", 0.0),
            ] {
                for beta in [0.1, 0.5, 2.0] {
                    let got = dpo_sums(&c, &r, rc, rr, beta, ls, t).unwrap();
                    let want = trl_dpo_loss((pc, nc, pr, nr, rc, rr), beta, ls, name);
                    assert_close(
                        &format!("{name} ls {ls} beta {beta}"),
                        got.loss,
                        want,
                        1e-12,
                        1e-14,
                    );
                    assert_eq!(got.metrics.get("loss"), Some(got.loss));
                }
            }
        }
        // Hand values. Case 1, beta 0.1: z = (-10 + 11) - (-14 + 13) = 2, beta z = 0.2;
        //   hinge = 1 - 0.2 = 0.8; robust(0.1) = (0.9 softplus(-0.2) - 0.1 softplus(0.2)) / 0.8.
        // IPO on means: z = (-2.5 + 2.75) - (-14/6 + 13/6) = 0.25 + 1/6, (z - 5)^2.
        let c = BranchSums {
            response: -10.0,
            n_response: 4,
            ..Default::default()
        };
        let r = BranchSums {
            response: -14.0,
            n_response: 6,
            ..Default::default()
        };
        let l = |t, ls| dpo_sums(&c, &r, -11.0, -13.0, 0.1, ls, t).unwrap().loss;
        let softplus = |x: f64| (1.0 + x.exp()).ln();
        assert_close("hinge", l(DpoLossType::Hinge, 0.0), 0.8, 1e-14, 0.0);
        assert_close(
            "robust",
            l(DpoLossType::Robust, 0.1),
            (0.9 * softplus(-0.2) - 0.1 * softplus(0.2)) / 0.8,
            1e-13,
            0.0,
        );
        let z: f64 = 0.25 + 1.0 / 6.0;
        assert_close(
            "ipo",
            l(DpoLossType::Ipo, 0.0),
            (z - 5.0).powi(2),
            1e-13,
            0.0,
        );
        // Past the hinge: no loss, no gradient.
        let far = dpo_sums(&c, &r, -11.0, -13.0, 1.0, 0.0, DpoLossType::Hinge).unwrap();
        assert_eq!((far.loss, far.coef), (0.0, [0.0; 3]));
        // IPO's metrics are on the means.
        let ipo = dpo_sums(&c, &r, -11.0, -13.0, 0.1, 0.0, DpoLossType::Ipo).unwrap();
        assert_close(
            "ipo logps/chosen",
            ipo.metrics.get("logps/chosen").unwrap(),
            -2.5,
            1e-15,
            0.0,
        );
        assert_close(
            "ipo margin",
            ipo.metrics.get("margin").unwrap(),
            0.1 * z,
            1e-13,
            0.0,
        );
    }

    #[test]
    fn dpo_loss_type_parameters_are_checked() {
        let c = BranchSums {
            response: -1.0,
            n_response: 1,
            ..Default::default()
        };
        let e = dpo_sums(&c, &c, -1.0, -1.0, 0.1, 0.5, DpoLossType::Robust).unwrap_err();
        assert!(e.contains("label_smoothing") && e.contains("0.5"), "{e}");
        assert!(dpo_sums(&c, &c, -1.0, -1.0, 0.1, 0.49, DpoLossType::Robust).is_ok());
        for t in [DpoLossType::Ipo, DpoLossType::Hinge] {
            let e = dpo_sums(&c, &c, -1.0, -1.0, 0.1, 0.1, t).unwrap_err();
            assert!(e.contains("label_smoothing"), "{e}");
            assert!(dpo_sums(&c, &c, -1.0, -1.0, 0.0, 0.0, t).is_err());
        }
    }

    #[test]
    fn clip_and_weight() {
        let c = BranchSums {
            response: -2.0,
            n_response: 2,
            ..Default::default()
        };
        let r = BranchSums {
            response: -1.0,
            n_response: 1,
            ..Default::default()
        };
        let base = simpo_sums(&c, &r, 2.0, 0.5).unwrap();
        // At or below the clip (and with no clip) nothing changes.
        for clip in [None, Some(base.loss), Some(base.loss * 3.0)] {
            let mut out = base.clone();
            assert!(!out.clip(clip));
            assert_eq!(out, base);
        }
        let mut out = base.clone();
        assert!(out.clip(Some(base.loss * 0.5)));
        assert_eq!((out.loss, out.coef), (base.loss * 0.5, [0.0; 3]));
        assert_eq!(
            out.metrics, base.metrics,
            "the metrics keep the unclipped loss"
        );
        let w = base.clone().weighted(2.5);
        assert_eq!(w.loss, base.loss * 2.5);
        assert_eq!(w.coef, base.coef.map(|g| g * 2.5));
        assert_eq!(w.metrics, base.metrics, "the metrics stay unweighted");
    }

    // ---- 4. stability ----

    fn assert_all_finite(name: &str, out: &ObjectiveOut) {
        assert!(out.loss.is_finite(), "{name}: loss {}", out.loss);
        for (n, v) in out.metrics.pairs() {
            assert!(v.is_finite(), "{name}: metric {n} = {v}");
        }
        for g in [&out.d_chosen, &out.d_rejected] {
            for &x in g.prompt.iter().chain(g.response.iter()) {
                assert!(x.is_finite(), "{name}: grad {x}");
            }
        }
    }

    #[test]
    fn stable_near_zero_and_very_negative() {
        let tiny = [-1e-7f32];
        let huge = [-50.0f32, -50.0];
        let zero = [0.0f32, 0.0];
        let prompt = [-3.0f32];
        let cases: [(&[f32], &[f32]); 6] = [
            (&tiny, &huge),
            (&huge, &tiny),
            (&tiny, &tiny),
            (&huge, &huge),
            (&zero, &huge),
            (&huge, &zero),
        ];
        for (c, r) in cases {
            for scope in [SftScope::Full, SftScope::Response] {
                for lambda in [0.1, 1.0] {
                    let out = orpo(
                        BranchLogps::new(&prompt, c),
                        BranchLogps::response_only(r),
                        lambda,
                        scope,
                    )
                    .unwrap();
                    assert_all_finite("orpo", &out);
                    // Chosen response grads are always negative (raising lw lowers the loss),
                    // rejected ones non-negative.
                    assert!(out.d_chosen.response.iter().all(|&g| g < 0.0));
                    assert!(out.d_rejected.response.iter().all(|&g| g >= 0.0));
                }
            }
            assert_all_finite("sft", &sft(BranchLogps::new(&prompt, c), true).unwrap());
            let d = dpo(
                BranchLogps::response_only(c),
                BranchLogps::response_only(r),
                -5000.0,
                5000.0,
                1.0,
                0.1,
                DpoLossType::Sigmoid,
            )
            .unwrap();
            assert_all_finite("dpo", &d);
            let s = simpo(
                BranchLogps::response_only(c),
                BranchLogps::response_only(r),
                1e3,
                0.5,
            )
            .unwrap();
            assert_all_finite("simpo", &s);
        }

        // Specific values: lw = -1e-7, lr = -50. log1mexp(-1e-7) = ln(1e-7 - 5e-15...) ~ -16.118,
        // log1mexp(-50) ~ -1.9e-22, so log_odds ~ 49.9999999 + 16.118 = 66.118 and L_OR ~ e^-66.
        let out = orpo(
            BranchLogps::response_only(&tiny),
            BranchLogps::response_only(&huge),
            1.0,
            SftScope::Response,
        )
        .unwrap();
        let lw = -1e-7f32 as f64;
        let lo = (lw + 50.0) - (-lw).ln();
        assert_close(
            "stable log_odds",
            metric(&out, "log_odds_chosen"),
            lo,
            1e-9,
            0.0,
        );
        assert!(metric(&out, "or") > 0.0 && metric(&out, "or") < 1e-28);
        // At the limit the chosen grad is -1 (NLL) plus a bounded OR part:
        // d_or * (1 + 1/expm1(1e-7)) ~ -e^-66 * 1e7 ~ -2e-22, so grad ~ -1.
        assert_close(
            "stable gc",
            out.d_chosen.response[0] as f64,
            -1.0,
            1e-6,
            0.0,
        );

        // Extremely confident (mean exactly 0): OR term vanishes, grad limit stays finite.
        let out = orpo(
            BranchLogps::response_only(&zero),
            BranchLogps::response_only(&[-1.0]),
            1.0,
            SftScope::Response,
        )
        .unwrap();
        assert_close("zero loss", out.loss, 0.0, 0.0, 1e-25);
    }

    #[test]
    fn invalid_inputs_are_errors() {
        let ok = [-1.0f32];
        let empty: [f32; 0] = [];
        let nan = [-1.0f32, f32::NAN];
        let inf = [f32::NEG_INFINITY];
        let pos = [0.5f32];
        let b = BranchLogps::response_only;

        let e = orpo(b(&empty), b(&ok), 0.1, SftScope::Full).unwrap_err();
        assert!(e.contains("chosen response is empty"), "{e}");
        let e = orpo(b(&ok), b(&empty), 0.1, SftScope::Full).unwrap_err();
        assert!(e.contains("rejected response is empty"), "{e}");
        let e = orpo(b(&ok), b(&nan), 0.1, SftScope::Full).unwrap_err();
        assert!(e.contains("not finite"), "{e}");
        let e = orpo(BranchLogps::new(&nan, &ok), b(&ok), 0.1, SftScope::Full).unwrap_err();
        assert!(e.contains("prompt"), "{e}");
        assert!(orpo(b(&inf), b(&ok), 0.1, SftScope::Full).is_err());
        assert!(orpo(b(&pos), b(&ok), 0.1, SftScope::Full)
            .unwrap_err()
            .contains("positive"));
        assert!(orpo(b(&ok), b(&ok), f64::NAN, SftScope::Full).is_err());
        assert!(orpo(b(&ok), b(&ok), -1.0, SftScope::Full).is_err());

        assert!(sft(b(&empty), true).unwrap_err().contains("empty"));
        assert!(sft(b(&nan), false).is_err());

        assert!(dpo(b(&empty), b(&ok), 0.0, 0.0, 0.1, 0.0, DpoLossType::Sigmoid).is_err());
        assert!(dpo(b(&ok), b(&inf), 0.0, 0.0, 0.1, 0.0, DpoLossType::Sigmoid).is_err());
        assert!(dpo(
            b(&ok),
            b(&ok),
            f64::NAN,
            0.0,
            0.1,
            0.0,
            DpoLossType::Sigmoid
        )
        .is_err());
        assert!(dpo(b(&ok), b(&ok), 0.0, 0.0, 0.0, 0.0, DpoLossType::Sigmoid).is_err());
        assert!(dpo(b(&ok), b(&ok), 0.0, 0.0, 0.1, 1.5, DpoLossType::Sigmoid).is_err());

        assert!(simpo(b(&ok), b(&empty), 2.0, 0.5).is_err());
        assert!(simpo(b(&ok), b(&ok), 2.0, f64::INFINITY).is_err());
        assert!(simpo(b(&ok), b(&ok), -2.0, 0.5).is_err());

        // Small positive rounding noise is tolerated.
        assert!(orpo(b(&[1e-6f32]), b(&ok), 0.1, SftScope::Full).is_ok());
    }
}
