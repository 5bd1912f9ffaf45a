//! The objective evaluated where the logps live, so that a training step queues its forward,
//! head, objective, backward and update without once waiting for the host.
//!
//! Every objective reads the per-token logps only through per-part sums
//! ([`objectives::BranchSums`]), so `d loss / d logp` is one constant per part. [`evaluate`]
//! reduces the parts, computes those constants and writes the per-token gradient on the logps'
//! device (CUDA: one kernel, `lf_obj_pair`, the device form of the `objectives::*_sums`
//! functions; CPU: the same steps on the host). The loss and the metrics come later, from
//! [`PendingLoss::finish`], which reads the sums back and evaluates `objectives` on them: the
//! step's one read-back, once everything else is queued.
//!
//! Per example, [`ExampleScale`] applies the example's weight (loss and gradient times it) and
//! the `loss_clip` (`SumsOut::clip`: a loss above the clip counts as the clip, with zero
//! gradient). Whether an example was clipped is decided where the coefficients are computed and
//! recorded in the stats, so that the loss `finish` reports matches the gradient written.

use super::objectives::{
    self, BranchSums, DpoLossType, Metrics, SftScope, SumsOut, LOGP_POSITIVE_TOLERANCE,
};
use super::step::Objective;
use crate::tensor::{Device, DeviceValues, Tensor};
use anyhow::{anyhow, bail, ensure, Result};
use std::sync::Arc;

/// Where each part lies in the logp vector, as `(start, len)`. A part nobody reads has length 0.
#[derive(Clone, Copy, Debug, Default)]
pub struct Parts {
    pub chosen_prompt: (usize, usize),
    pub chosen_response: (usize, usize),
    pub rejected_response: Option<(usize, usize)>,
}

impl Parts {
    fn spans(&self) -> [(usize, usize); 3] {
        [
            self.chosen_prompt,
            self.chosen_response,
            self.rejected_response.unwrap_or((0, 0)),
        ]
    }
}

const PART_NAMES: [&str; 3] = ["chosen prompt", "chosen response", "rejected response"];

/// Values in the stats (`CudaBackend::pair_objective` documents the layout).
const STATS: usize = 9;
const BAD_INDEX: usize = 3;
const BAD_VALUE: usize = 4;
const COEF: usize = 5;
const CLIPPED: usize = 8;

/// How one example's loss enters the step: its weight (a preference row's `weight`: loss and
/// gradient times it, metrics unweighted) and the configured `loss_clip` (applied to the
/// objective's loss before the weight).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExampleScale {
    pub weight: f64,
    pub clip: Option<f64>,
}

impl Default for ExampleScale {
    fn default() -> Self {
        ExampleScale {
            weight: 1.0,
            clip: None,
        }
    }
}

/// DPO's reference: the stats of the adapter-off logps (response sums at 1 and 2), kept on the
/// device and shared by every step that reads the same example.
#[derive(Clone)]
pub struct Reference(Arc<(DeviceValues, [(usize, usize); 3])>);

impl Reference {
    /// The chosen and rejected response sums (a sync point on CUDA); a bad reference logp is
    /// reported here.
    fn sums(&self) -> Result<(f64, f64)> {
        let (values, spans) = &*self.0;
        let v = values.to_host()?;
        check_stats(&v, spans, "DPO reference")?;
        Ok((v[1], v[2]))
    }
}

/// An objective queued on the device; [`PendingLoss::finish`] reads it back.
pub struct PendingLoss {
    stats: DeviceValues,
    objective: Objective,
    spans: [(usize, usize); 3],
    reference: Option<Reference>,
    scale: ExampleScale,
}

/// The kernel's objective code and parameters (`objective.cu`).
fn kind(objective: &Objective) -> (i32, [f64; 2]) {
    match *objective {
        Objective::Orpo {
            lambda,
            scope: SftScope::Full,
        } => (1, [lambda, 0.0]),
        Objective::Orpo {
            lambda,
            scope: SftScope::Response,
        } => (2, [lambda, 0.0]),
        Objective::Sft { all_tokens: false } => (3, [0.0, 0.0]),
        Objective::Sft { all_tokens: true } => (4, [0.0, 0.0]),
        Objective::Dpo {
            beta,
            label_smoothing,
            loss_type,
        } => (
            match loss_type {
                DpoLossType::Sigmoid => 5,
                DpoLossType::Ipo => 7,
                DpoLossType::Hinge => 8,
                DpoLossType::Robust => 9,
            },
            [beta, label_smoothing],
        ),
        Objective::Simpo { beta, gamma } => (6, [beta, gamma]),
    }
}

/// The objective on part sums (`sums` as in the stats; `reference` the adapter-off response sums).
fn on_sums(
    objective: &Objective,
    sums: [f64; 3],
    counts: [usize; 3],
    reference: (f64, f64),
) -> Result<SumsOut> {
    let chosen = BranchSums {
        prompt: sums[0],
        n_prompt: counts[0],
        response: sums[1],
        n_response: counts[1],
    };
    let rejected = BranchSums {
        response: sums[2],
        n_response: counts[2],
        ..BranchSums::default()
    };
    match *objective {
        Objective::Orpo { lambda, scope } => {
            objectives::orpo_sums(&chosen, &rejected, lambda, scope)
        }
        Objective::Sft { all_tokens } => objectives::sft_sums(&chosen, all_tokens),
        Objective::Dpo {
            beta,
            label_smoothing,
            loss_type,
        } => objectives::dpo_sums(
            &chosen,
            &rejected,
            reference.0,
            reference.1,
            beta,
            label_smoothing,
            loss_type,
        ),
        Objective::Simpo { beta, gamma } => objectives::simpo_sums(&chosen, &rejected, beta, gamma),
    }
    .map_err(|e| anyhow!("objective: {e}"))
}

/// Sums, first bad token and (with `coef`) coefficients of the parts and whether the loss was
/// clipped, on the host: what `lf_obj_pair` writes to its stats.
fn host_stats(
    logp: &[f32],
    spans: [(usize, usize); 3],
    coef: impl FnOnce([f64; 3]) -> Result<([f64; 3], bool)>,
) -> Result<Vec<f64>> {
    let mut stats = vec![0.0; STATS];
    let mut bad: Option<usize> = None;
    for (p, &(start, len)) in spans.iter().enumerate() {
        for (i, &x) in logp[start..start + len].iter().enumerate() {
            let x = x as f64;
            if !(x.is_finite() && x <= LOGP_POSITIVE_TOLERANCE) {
                bad = Some(bad.map_or(start + i, |b| b.min(start + i)));
            }
            stats[p] += x;
        }
    }
    match bad {
        Some(i) => {
            stats[BAD_INDEX] = i as f64;
            stats[BAD_VALUE] = logp[i] as f64;
        }
        None => {
            stats[BAD_INDEX] = -1.0;
            let (c, clipped) = coef([stats[0], stats[1], stats[2]])?;
            stats[COEF..COEF + 3].copy_from_slice(&c);
            stats[CLIPPED] = if clipped { 1.0 } else { 0.0 };
        }
    }
    Ok(stats)
}

fn check_spans(logp: &Tensor, spans: &[(usize, usize); 3]) -> Result<()> {
    ensure!(logp.shape().len() == 1, "objective: logps must be a vector");
    for (name, &(s, l)) in PART_NAMES.iter().zip(spans) {
        ensure!(
            s + l <= logp.numel(),
            "objective: {name} rows {s}..{} past the {} logps",
            s + l,
            logp.numel()
        );
    }
    Ok(())
}

/// Queues `objective` on `logp` (f32, one per head row) and returns it pending, with
/// `d loss / d logp · weight · scale.weight` for every row (0 on rows outside the parts; 0
/// everywhere when `scale.clip` clips the loss). Hyperparameters, the scale and empty responses
/// are checked here; bad logps (non-finite or positive) are reported by `finish`.
pub fn evaluate(
    logp: &Tensor,
    parts: &Parts,
    objective: &Objective,
    reference: Option<&Reference>,
    weight: f32,
    scale: ExampleScale,
) -> Result<(PendingLoss, Tensor)> {
    let spans = parts.spans();
    check_spans(logp, &spans)?;
    let counts = spans.map(|(_, l)| l);
    if objective.is_preference() && parts.rejected_response.is_none() {
        bail!("objective {objective:?} needs a preference example");
    }
    if matches!(objective, Objective::Dpo { .. }) && reference.is_none() {
        bail!("DPO needs reference logps");
    }
    ensure!(
        scale.weight.is_finite() && scale.weight >= 0.0,
        "objective: example weight {} (expected a finite number >= 0)",
        scale.weight
    );
    if let Some(c) = scale.clip {
        ensure!(
            c.is_finite() && c > 0.0,
            "objective: loss_clip = {c} (expected a finite number > 0)"
        );
    }
    if let (Some(r), Objective::Dpo { .. }) = (reference, objective) {
        let ref_spans = &r.0 .1;
        ensure!(
            ref_spans[1].1 == counts[1] && ref_spans[2].1 == counts[2],
            "DPO reference has {}+{} response logps, the policy {}+{}",
            ref_spans[1].1,
            ref_spans[2].1,
            counts[1],
            counts[2]
        );
    }
    let weight = weight * scale.weight as f32;
    // Hyperparameters and counts, checked on stand-in sums (every mean -1) before any launch.
    on_sums(objective, counts.map(|n| -(n as f64)), counts, (-1.0, -1.0))?;
    let (code, params) = kind(objective);
    let (stats, dlogp) = match logp.device() {
        Device::Cpu => {
            let reference = match reference {
                Some(r) => r.sums()?,
                None => (0.0, 0.0),
            };
            let lp = logp.as_cpu()?;
            let stats = host_stats(lp, spans, |sums| {
                let mut out = on_sums(objective, sums, counts, reference)?;
                let clipped = out.clip(scale.clip);
                Ok((out.coef, clipped))
            })?;
            let mut d = vec![0f32; lp.len()];
            if stats[BAD_INDEX] < 0.0 {
                for (p, &(start, len)) in spans.iter().enumerate() {
                    let g = stats[COEF + p] as f32 * weight;
                    d[start..start + len].fill(g);
                }
            }
            (DeviceValues::cpu(stats), Tensor::cpu(d, &[lp.len()])?)
        }
        Device::Cuda(c) => c.pair_objective(
            logp,
            spans,
            code,
            params,
            reference.map(|r| &r.0 .0),
            scale.clip,
            weight,
        )?,
    };
    Ok((
        PendingLoss {
            stats,
            objective: *objective,
            spans,
            reference: reference.cloned(),
            scale,
        },
        dlogp,
    ))
}

/// The adapter-off response sums of a DPO example, left on the device.
pub fn reference(logp: &Tensor, parts: &Parts) -> Result<Reference> {
    let spans = parts.spans();
    check_spans(logp, &spans)?;
    let stats = match logp.device() {
        Device::Cpu => DeviceValues::cpu(host_stats(logp.as_cpu()?, spans, |_| {
            Ok(([0.0; 3], false))
        })?),
        Device::Cuda(c) => {
            c.pair_objective(logp, spans, 0, [0.0; 2], None, None, 0.0)?
                .0
        }
    };
    Ok(Reference(Arc::new((stats, spans))))
}

/// Reports a bad logp recorded in `stats`, naming its part (`what` names the pass).
fn check_stats(stats: &[f64], spans: &[(usize, usize); 3], what: &str) -> Result<()> {
    if stats[BAD_INDEX] < 0.0 {
        return Ok(());
    }
    let i = stats[BAD_INDEX] as usize;
    let (name, at) = PART_NAMES
        .iter()
        .zip(spans)
        .find(|(_, &(s, l))| (s..s + l).contains(&i))
        .map_or(("logp vector", i), |(n, &(s, _))| (*n, i - s));
    bail!(
        "{what}: {name} logp[{at}] = {} is not a log-probability (non-finite, or above {LOGP_POSITIVE_TOLERANCE})",
        stats[BAD_VALUE]
    )
}

impl PendingLoss {
    /// Reads the stats back (a sync point on CUDA) and evaluates the loss and metrics: the loss
    /// clipped (as the stats record) and weighted by the example's scale, the metrics as the
    /// objective gives them.
    pub fn finish(self) -> Result<(f64, Metrics)> {
        let stats = self.stats.to_host()?;
        check_stats(&stats, &self.spans, "objective")?;
        let reference = match &self.reference {
            Some(r) => r.sums()?,
            None => (0.0, 0.0),
        };
        let out = on_sums(
            &self.objective,
            [stats[0], stats[1], stats[2]],
            self.spans.map(|(_, l)| l),
            reference,
        )?;
        let loss = match self.scale.clip {
            Some(c) if stats[CLIPPED] > 0.5 => c,
            _ => out.loss,
        };
        Ok((loss * self.scale.weight, out.metrics))
    }
}

/// The objectives the parity rows and tests exercise, one of each kind (every DPO loss type).
fn all_objectives() -> [Objective; 9] {
    [
        Objective::Orpo {
            lambda: 0.25,
            scope: SftScope::Full,
        },
        Objective::Orpo {
            lambda: 0.1,
            scope: SftScope::Response,
        },
        Objective::Sft { all_tokens: false },
        Objective::Sft { all_tokens: true },
        Objective::Dpo {
            beta: 0.1,
            label_smoothing: 0.1,
            loss_type: DpoLossType::Sigmoid,
        },
        Objective::Simpo {
            beta: 2.0,
            gamma: 0.5,
        },
        Objective::Dpo {
            beta: 0.1,
            label_smoothing: 0.0,
            loss_type: DpoLossType::Ipo,
        },
        // A small beta keeps the random cases' margins (hundreds of nats) on the hinge's slope.
        Objective::Dpo {
            beta: 1e-3,
            label_smoothing: 0.0,
            loss_type: DpoLossType::Hinge,
        },
        Objective::Dpo {
            beta: 0.1,
            label_smoothing: 0.2,
            loss_type: DpoLossType::Robust,
        },
    ]
}

/// Random logps laid out as the step lays them out (prompt, chosen response, rejected response
/// end to end), with `reference` logps for DPO.
fn random_case(seed: u64, n: [usize; 3]) -> (Vec<f32>, Vec<f32>, Parts) {
    let mut rng = crate::tensor::Rng(seed);
    let mut draw = |k: usize| -> Vec<f32> {
        (0..k)
            .map(|_| -((rng.next_u64() % 4000) as f32) / 1000.0 - 1e-3)
            .collect()
    };
    let logp = draw(n.iter().sum());
    let reference = draw(n[1] + n[2]);
    let parts = Parts {
        chosen_prompt: (0, n[0]),
        chosen_response: (n[0], n[1]),
        rejected_response: Some((n[0] + n[1], n[2])),
    };
    (logp, reference, parts)
}

/// `evaluate` on `device` against the CPU for every objective (the gradient written per token,
/// the finished loss) and a bad token reported the same way by both: rows for
/// `lorafit selftest`.
pub fn parity_rows(device: &Device) -> Result<Vec<crate::tensor::parity::ParityRow>> {
    use crate::tensor::parity::compare;
    use crate::tensor::DType;
    let mut rows = Vec::new();
    // Long parts, so that every thread of the kernel holds several tokens of each.
    let n = [3000, 2500, 1700];
    let (logp, ref_logp, parts) = random_case(3, n);
    let ref_parts = Parts {
        chosen_prompt: (0, 0),
        chosen_response: (0, n[1]),
        rejected_response: Some((n[1], n[2])),
    };
    let on = |dev: &Device, x: &[f32]| Tensor::from_f32(x, &[x.len()], DType::F32, dev);
    let (cpu_ref, dev_ref) = (
        reference(&on(&Device::Cpu, &ref_logp)?, &ref_parts)?,
        reference(&on(device, &ref_logp)?, &ref_parts)?,
    );
    let run = |dev: &Device, r: &Reference, objective: &Objective, scale: ExampleScale| {
        let (pending, d) = evaluate(&on(dev, &logp)?, &parts, objective, Some(r), 0.5, scale)?;
        anyhow::Ok((pending.finish()?.0, d.to_vec()?))
    };
    let mut row_for = |what: String, objective: &Objective, scale: ExampleScale| -> Result<f64> {
        let (want_loss, want) = run(&Device::Cpu, &cpu_ref, objective, scale)?;
        let (got_loss, got) = run(device, &dev_ref, objective, scale)?;
        let mut row = compare(&what, &got, &want, 1e-6);
        let loss_rel = (got_loss - want_loss).abs() / want_loss.abs().max(1e-300);
        row.note = format!("loss {got_loss:.6} vs {want_loss:.6} (rel {loss_rel:.1e})");
        // Sums in another order only: the loss agrees far below f32 rounding.
        row.pass &= loss_rel <= 1e-9;
        rows.push(row);
        Ok(want_loss)
    };
    for objective in all_objectives() {
        let loss = row_for(
            format!("objective {objective:?}: d loss / d logp"),
            &objective,
            ExampleScale::default(),
        )?;
        // The example weight, and the loss clip on either side of the loss (clipped: the
        // gradient is zero on both backends, the loss is the clip).
        for (weight, clip) in [(1.75, 2.0), (0.5, 0.5)] {
            let scale = ExampleScale {
                weight,
                clip: Some(loss.abs().max(1e-3) * clip),
            };
            row_for(
                format!(
                    "objective {objective:?}, weight {weight}, clip {clip}·loss: d loss / d logp"
                ),
                &objective,
                scale,
            )?;
        }
    }
    // A non-finite token in the rejected response: both backends name it at finish.
    let mut bad = logp.clone();
    bad[n[0] + n[1] + 17] = f32::NAN;
    let objective = all_objectives()[0];
    let message = |dev: &Device| -> Result<String> {
        let (pending, d) = evaluate(
            &on(dev, &bad)?,
            &parts,
            &objective,
            None,
            1.0,
            ExampleScale::default(),
        )?;
        let zero = d.to_vec()?.iter().all(|&x| x == 0.0);
        Ok(format!(
            "{} (gradient zero: {zero})",
            pending
                .finish()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        ))
    };
    let (want, got) = (message(&Device::Cpu)?, message(device)?);
    let mut row = compare("objective: bad logp reported", &[0.0], &[0.0], 0.0);
    row.pass = want == got && want.contains("rejected response logp[17]");
    row.note = got;
    rows.push(row);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::objectives::per_token::{self, BranchLogps};

    /// The CPU form of `evaluate` against the per-token reference functions of `objectives`:
    /// the same loss, metrics and gradient for every objective.
    #[test]
    fn evaluate_matches_the_per_token_objectives() {
        let n = [7, 5, 4];
        let (logp, ref_logp, parts) = random_case(9, n);
        let (cp, cr, rr) = (
            &logp[..n[0]],
            &logp[n[0]..n[0] + n[1]],
            &logp[n[0] + n[1]..],
        );
        let refs = (
            ref_logp[..n[1]].iter().map(|&x| x as f64).sum::<f64>(),
            ref_logp[n[1]..].iter().map(|&x| x as f64).sum::<f64>(),
        );
        let reference = reference_of(&ref_logp, n);
        let x = Tensor::cpu(logp.clone(), &[logp.len()]).unwrap();
        for objective in all_objectives() {
            let chosen = BranchLogps::new(cp, cr);
            let rejected = BranchLogps::response_only(rr);
            let want = match objective {
                Objective::Orpo { lambda, scope } => {
                    per_token::orpo(chosen, rejected, lambda, scope)
                }
                Objective::Sft { all_tokens } => per_token::sft(chosen, all_tokens),
                Objective::Dpo {
                    beta,
                    label_smoothing,
                    loss_type,
                } => per_token::dpo(
                    chosen,
                    rejected,
                    refs.0,
                    refs.1,
                    beta,
                    label_smoothing,
                    loss_type,
                ),
                Objective::Simpo { beta, gamma } => per_token::simpo(chosen, rejected, beta, gamma),
            }
            .unwrap();
            let (pending, d) = evaluate(
                &x,
                &parts,
                &objective,
                Some(&reference),
                0.5,
                ExampleScale::default(),
            )
            .unwrap();
            let d = d.to_vec().unwrap();
            let (loss, metrics) = pending.finish().unwrap();
            assert!(
                (loss - want.loss).abs() <= 1e-12 * want.loss.abs(),
                "{objective:?}"
            );
            assert_eq!(metrics.pairs().len(), want.metrics.pairs().len());
            for ((k, a), (_, b)) in metrics.pairs().iter().zip(want.metrics.pairs()) {
                assert!(
                    (a - b).abs() <= 1e-12 * b.abs().max(1.0),
                    "{objective:?} {k}"
                );
            }
            // SFT reads the prompt only with all tokens; ORPO only with full scope.
            let dr = if want.d_rejected.response.is_empty() {
                vec![0.0; n[2]]
            } else {
                want.d_rejected.response.clone()
            };
            let expect: Vec<f32> = [&want.d_chosen.prompt[..], &want.d_chosen.response, &dr]
                .concat()
                .iter()
                .map(|g| g * 0.5)
                .collect();
            assert_eq!(d, expect, "{objective:?}");
        }
    }

    /// The reference of a random case: its chosen and rejected response logps (`n` as in
    /// `random_case`).
    fn reference_of(ref_logp: &[f32], n: [usize; 3]) -> Reference {
        let ref_parts = Parts {
            chosen_prompt: (0, 0),
            chosen_response: (0, n[1]),
            rejected_response: Some((n[1], n[2])),
        };
        let t = Tensor::cpu(ref_logp.to_vec(), &[ref_logp.len()]).unwrap();
        reference(&t, &ref_parts).unwrap()
    }

    /// The example weight scales loss and gradient (metrics unweighted); a loss above the clip
    /// counts as the clip with zero gradient, at or below it nothing changes.
    #[test]
    fn weight_and_clip() {
        let n = [4, 3, 5];
        let (logp, ref_logp, parts) = random_case(5, n);
        let reference = reference_of(&ref_logp, n);
        let x = Tensor::cpu(logp.clone(), &[logp.len()]).unwrap();
        for objective in all_objectives() {
            let run = |scale| {
                let (p, d) =
                    evaluate(&x, &parts, &objective, Some(&reference), 0.5, scale).unwrap();
                let (loss, m) = p.finish().unwrap();
                (loss, m, d.to_vec().unwrap())
            };
            let (loss, metrics, d) = run(ExampleScale::default());
            assert!(loss > 0.0, "{objective:?}: {loss}");
            let (wl, wm, wd) = run(ExampleScale {
                weight: 2.5,
                clip: Some(loss * 1.5),
            });
            assert!((wl - 2.5 * loss).abs() <= 1e-12 * loss, "{objective:?}");
            assert_eq!(wm, metrics, "{objective:?}: the metrics stay unweighted");
            assert_eq!(wd, d.iter().map(|g| g * 2.5).collect::<Vec<_>>());
            let (cl, cm, cd) = run(ExampleScale {
                weight: 2.0,
                clip: Some(loss * 0.5),
            });
            assert_eq!(cl, loss, "{objective:?}: 2 · (loss / 2)");
            assert_eq!(cm, metrics);
            assert!(cd.iter().all(|&g| g == 0.0), "{objective:?}");
            let (zl, _, zd) = run(ExampleScale {
                weight: 0.0,
                clip: None,
            });
            assert_eq!(zl, 0.0);
            assert!(zd.iter().all(|&g| g == 0.0));
        }
        let orpo = all_objectives()[0];
        for scale in [
            ExampleScale {
                weight: -1.0,
                clip: None,
            },
            ExampleScale {
                weight: f64::NAN,
                clip: None,
            },
            ExampleScale {
                weight: 1.0,
                clip: Some(0.0),
            },
        ] {
            assert!(evaluate(&x, &parts, &orpo, None, 1.0, scale).is_err());
        }
    }

    #[test]
    fn bad_input_is_named() {
        let n = [3, 4, 2];
        let (mut logp, _, parts) = random_case(1, n);
        logp[n[0] + 2] = 0.5;
        let x = Tensor::cpu(logp, &[9]).unwrap();
        let orpo = all_objectives()[0];
        let (pending, d) = evaluate(&x, &parts, &orpo, None, 1.0, ExampleScale::default()).unwrap();
        assert!(d.to_vec().unwrap().iter().all(|&g| g == 0.0));
        let e = pending.finish().unwrap_err().to_string();
        assert!(e.contains("chosen response logp[2] = 0.5"), "{e}");
        // Checked before anything runs: hyperparameters, a missing branch or reference.
        let bad_lambda = Objective::Orpo {
            lambda: -1.0,
            scope: SftScope::Full,
        };
        let e = evaluate(&x, &parts, &bad_lambda, None, 1.0, ExampleScale::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("lambda"), "{e}");
        let no_rejected = Parts {
            rejected_response: None,
            ..parts
        };
        assert!(evaluate(&x, &no_rejected, &orpo, None, 1.0, ExampleScale::default()).is_err());
        let dpo = all_objectives()[4];
        let e = evaluate(&x, &parts, &dpo, None, 1.0, ExampleScale::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("reference"), "{e}");
        let empty = Parts {
            chosen_response: (3, 0),
            ..parts
        };
        let e = evaluate(&x, &empty, &orpo, None, 1.0, ExampleScale::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("empty"), "{e}");
    }
}
