//! ORPO's λ as a controlled quantity (`orpo_lambda_schedule = "adaptive"`): a phase machine
//! that reads the validation `lw` and `lr` (mean response logps of chosen and rejected) at each
//! evaluation and sets the λ of the steps that follow.
//!
//! - **warmup**: λ = `orpo_lambda_min` (nearly pure SFT) until validation `lw` plateaus: its
//!   trend is within the noise for `orpo_lambda_patience` evaluations in a row; or, at the
//!   latest, at the first evaluation at or past `orpo_lambda_warmup_max` of the run's steps (in
//!   a short run SFT may still be gaining when the run ends, and a warm-up without that limit
//!   would hold λ at the floor throughout). The ramp then starts at `orpo_lambda`, the static
//!   setting, rather than climbing from the floor. Both are
//!   measured here, over the last `max(4, 2 × patience) + 1` warm-up evaluations: a
//!   least-squares line through `lw`'s values gives the trend (its slope, the gain per
//!   evaluation) and the noise (the residuals about the line, so that the trend is not counted
//!   as noise); the threshold is [`NOISE_SIGMAS`] standard deviations of one
//!   evaluation-to-evaluation change (√2 × the residuals' standard deviation), never below
//!   `orpo_lambda_noise_floor`. The gain is flat when the slope is within [`NOISE_SIGMAS`] of
//!   its standard errors of zero (or below the floor); the threshold is fixed when warm-up ends.
//! - **ramp**: each evaluation at which `lw` holds (it fell by no more than the threshold since
//!   the last evaluation, and is no more than the threshold below its reference level, the best
//!   `lw` seen since the ramp began) multiplies λ by `orpo_lambda_ramp`, up to
//!   `orpo_lambda_max`.
//! - **displacement**: `lw` fell beyond the threshold (from the last evaluation or from its
//!   reference) while `lr` fell too: the margin is being bought by pushing both responses down.
//!   `orpo_lambda_patience` such evaluations in a row multiply λ by `orpo_lambda_backoff` (not
//!   below `orpo_lambda_min`) and enter **backoff**; a single one only holds λ (hysteresis).
//! - **backoff**: λ holds (and backs off again on continued displacement) until `lw` recovers:
//!   back within the threshold of its reference for `patience` evaluations, or stable (not
//!   falling beyond the threshold) for twice that, in which case its current level becomes the
//!   new reference. Then ramping resumes, so the run never settles at `orpo_lambda_min`.
//!
//! The state is plain data saved in every checkpoint's trainer state; its numbers are written
//! as Rust's shortest round-trip decimal strings so that a resumed run continues with exactly
//! the same values.

use crate::config::{LambdaSchedule, Method, TrainConfig};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The noise threshold in standard deviations of `lw`'s evaluation-to-evaluation change.
pub const NOISE_SIGMAS: f64 = 2.0;

/// The controller's phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Warmup,
    Ramp,
    Backoff,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Warmup => "warmup",
            Phase::Ramp => "ramp",
            Phase::Backoff => "backoff",
        }
    }

    /// The number metrics.jsonl records as `orpo_lambda_phase`: 0 warmup, 1 ramp, 2 backoff.
    pub fn code(self) -> f64 {
        match self {
            Phase::Warmup => 0.0,
            Phase::Ramp => 1.0,
            Phase::Backoff => 2.0,
        }
    }

    pub fn from_code(code: f64) -> Option<Phase> {
        [Phase::Warmup, Phase::Ramp, Phase::Backoff]
            .into_iter()
            .find(|p| p.code() == code)
    }
}

/// The controller's settings (`orpo_lambda_*` in `TrainConfig`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambdaParams {
    pub min: f64,
    pub max: f64,
    pub ramp: f64,
    pub backoff: f64,
    pub patience: usize,
    pub noise_floor: f64,
    /// λ when warm-up ends (`orpo_lambda`, within [min, max]).
    pub start: f64,
    /// Warm-up ends at the first evaluation at or past this step, plateau or not.
    pub warmup_max_step: usize,
}

impl LambdaParams {
    /// The settings of a run of `total_steps` steps.
    pub fn from_config(cfg: &TrainConfig, total_steps: usize) -> LambdaParams {
        LambdaParams {
            min: cfg.orpo_lambda_min,
            max: cfg.orpo_lambda_max,
            ramp: cfg.orpo_lambda_ramp,
            backoff: cfg.orpo_lambda_backoff,
            patience: cfg.orpo_lambda_patience.max(1),
            noise_floor: cfg.orpo_lambda_noise_floor,
            start: cfg
                .orpo_lambda
                .clamp(cfg.orpo_lambda_min, cfg.orpo_lambda_max),
            warmup_max_step: (cfg.orpo_lambda_warmup_max * total_steps as f64).ceil() as usize,
        }
    }

    /// Warm-up changes the trend and noise are measured over: the latest `max(4, 2 × patience)`
    /// (so one more value).
    fn window(&self) -> usize {
        (2 * self.patience).max(4)
    }
}

/// The adaptive schedule needs ORPO, validation data and evaluations: refused otherwise, naming
/// the setting.
pub fn check_adaptive(cfg: &TrainConfig, valid_examples: usize) -> Result<()> {
    if cfg.orpo_lambda_schedule != LambdaSchedule::Adaptive {
        return Ok(());
    }
    if cfg.method != Method::Orpo {
        bail!(
            "orpo_lambda_schedule = \"adaptive\" needs method = \"orpo\" (method is {:?})",
            cfg.method
        );
    }
    if cfg.eval_every == 0 {
        bail!("orpo_lambda_schedule = \"adaptive\" needs eval_every > 0: λ is set from the validation lw and lr at each evaluation");
    }
    if valid_examples == 0 {
        bail!("orpo_lambda_schedule = \"adaptive\" needs validation data (`valid`, --valid FILE.jsonl): λ is set from the validation lw and lr at each evaluation");
    }
    Ok(())
}

/// The controller's state: what it has seen and what it decided.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LambdaController {
    pub phase: Phase,
    /// λ for the steps until the next evaluation.
    #[serde(with = "exact")]
    pub lambda: f64,
    /// Evaluations observed.
    pub evals: usize,
    #[serde(with = "exact")]
    prev_lw: f64,
    #[serde(with = "exact")]
    prev_lr: f64,
    /// Warm-up: the latest `lw` values (at most the window + 1, the first evaluation's
    /// included).
    #[serde(with = "exact_vec")]
    window_lw: Vec<f64>,
    /// The noise threshold on a change of `lw` (fixed when warm-up ends; during warm-up, the
    /// current estimate).
    #[serde(with = "exact")]
    pub threshold: f64,
    /// `lw`'s reference level: at the plateau, then the best since.
    #[serde(with = "exact")]
    pub lw_ref: f64,
    /// Consecutive flat evaluations (warmup).
    plateau: usize,
    /// Consecutive displaced evaluations (ramp, backoff).
    displaced: usize,
    /// Consecutive evaluations with `lw` back at its reference (backoff).
    recovered: usize,
    /// Consecutive evaluations with `lw` not falling (backoff).
    held: usize,
    /// Back-offs so far.
    pub backoffs: usize,
}

impl LambdaController {
    pub fn new(p: &LambdaParams) -> LambdaController {
        LambdaController {
            phase: Phase::Warmup,
            lambda: p.min,
            evals: 0,
            prev_lw: 0.0,
            prev_lr: 0.0,
            window_lw: Vec::new(),
            threshold: p.noise_floor,
            lw_ref: 0.0,
            plateau: 0,
            displaced: 0,
            recovered: 0,
            held: 0,
            backoffs: 0,
        }
    }

    /// The trend and noise of `lw` over the warm-up window: a least-squares line through the
    /// window's values; its slope (the gain per evaluation); the threshold, `NOISE_SIGMAS` ×
    /// the standard deviation of one evaluation-to-evaluation change (√2 × the residuals'
    /// standard deviation about the line, so that the trend itself is not counted as noise), at
    /// least the floor; and the slope below which the gain counts as flat, `NOISE_SIGMAS`
    /// standard errors of the slope, at least the floor. `None` until the window is full.
    fn trend(&self, p: &LambdaParams) -> Option<(f64, f64, f64)> {
        if self.window_lw.len() < p.window() + 1 {
            return None;
        }
        self.trend_of_window(p)
    }

    /// `trend` over however many values the window holds (at least 3, for a line and a
    /// residual): the estimate a warm-up cut short by `warmup_max_step` ends with.
    fn trend_of_window(&self, p: &LambdaParams) -> Option<(f64, f64, f64)> {
        let y = &self.window_lw;
        let m = y.len();
        if m < 3 {
            return None;
        }
        let mf = m as f64;
        let x_mean = (mf - 1.0) / 2.0;
        let y_mean = y.iter().sum::<f64>() / mf;
        let (mut sxy, mut sxx) = (0.0, 0.0);
        for (i, v) in y.iter().enumerate() {
            let dx = i as f64 - x_mean;
            sxy += dx * (v - y_mean);
            sxx += dx * dx;
        }
        let slope = sxy / sxx;
        let rss: f64 = y
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let r = v - (y_mean + slope * (i as f64 - x_mean));
                r * r
            })
            .sum();
        let sigma = (rss / (mf - 2.0)).sqrt();
        let threshold = (NOISE_SIGMAS * std::f64::consts::SQRT_2 * sigma).max(p.noise_floor);
        // The slope's own standard error: the gain is "flat" when it is within NOISE_SIGMAS of
        // them of zero (or below the floor).
        let flat_below = (NOISE_SIGMAS * sigma / sxx.sqrt()).max(p.noise_floor);
        Some((slope, threshold, flat_below))
    }

    fn ramp(&mut self, p: &LambdaParams) {
        self.lambda = (self.lambda * p.ramp).min(p.max);
    }

    fn back_off(&mut self, p: &LambdaParams) {
        self.lambda = (self.lambda * p.backoff).max(p.min);
        self.phase = Phase::Backoff;
        self.displaced = 0;
        self.recovered = 0;
        self.held = 0;
        self.backoffs += 1;
    }

    /// One evaluation's validation `lw` and `lr`, taken after `step` steps; sets `lambda` and
    /// `phase` for the steps that follow. A non-finite value changes nothing.
    pub fn observe(&mut self, lw: f64, lr: f64, step: usize, p: &LambdaParams) {
        if !(lw.is_finite() && lr.is_finite()) {
            return;
        }
        self.evals += 1;
        if self.evals == 1 {
            (self.prev_lw, self.prev_lr, self.lw_ref) = (lw, lr, lw);
            self.window_lw.push(lw);
            return;
        }
        let d_lw = lw - self.prev_lw;
        let d_lr = lr - self.prev_lr;
        (self.prev_lw, self.prev_lr) = (lw, lr);
        match self.phase {
            Phase::Warmup => {
                self.window_lw.push(lw);
                if self.window_lw.len() > p.window() + 1 {
                    self.window_lw.remove(0);
                }
                let flat = match self.trend(p) {
                    Some((slope, threshold, flat_below)) => {
                        self.threshold = threshold;
                        slope < flat_below
                    }
                    None => false,
                };
                self.plateau = if flat { self.plateau + 1 } else { 0 };
                let cut_short = step >= p.warmup_max_step;
                if self.plateau >= p.patience || cut_short {
                    if self.plateau < p.patience {
                        // The noise from the values there are; the floor without three.
                        if let Some((_, threshold, _)) = self.trend_of_window(p) {
                            self.threshold = threshold;
                        }
                    }
                    self.phase = Phase::Ramp;
                    self.lw_ref = lw;
                    self.plateau = 0;
                    self.window_lw.clear();
                    self.lambda = p.start.max(self.lambda * p.ramp).min(p.max);
                }
            }
            Phase::Ramp | Phase::Backoff => {
                let eps = self.threshold;
                let lw_fell = d_lw < -eps || lw < self.lw_ref - eps;
                let displaced = lw_fell && d_lr < 0.0;
                self.displaced = if displaced { self.displaced + 1 } else { 0 };
                if self.phase == Phase::Ramp {
                    if self.displaced >= p.patience {
                        self.back_off(p);
                    } else if !lw_fell {
                        self.lw_ref = self.lw_ref.max(lw);
                        self.ramp(p);
                    }
                    return;
                }
                if displaced {
                    self.recovered = 0;
                    self.held = 0;
                    if self.displaced >= p.patience {
                        self.back_off(p);
                    }
                    return;
                }
                self.recovered = if !lw_fell { self.recovered + 1 } else { 0 };
                self.held = if d_lw >= -eps { self.held + 1 } else { 0 };
                if self.recovered >= p.patience || self.held >= 2 * p.patience {
                    if self.recovered < p.patience {
                        // Stable below the old reference: a new level to hold.
                        self.lw_ref = lw;
                    }
                    self.lw_ref = self.lw_ref.max(lw);
                    self.phase = Phase::Ramp;
                    self.recovered = 0;
                    self.held = 0;
                    self.ramp(p);
                }
            }
        }
    }
}

/// An `f64` as Rust's shortest decimal string that parses back to the same bits.
mod exact {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:?}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// [`exact`] for a list.
mod exact_vec {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[f64], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|x| format!("{x:?}")))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|t| t.parse().map_err(serde::de::Error::custom))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> LambdaParams {
        LambdaParams {
            min: 0.01,
            max: 1.0,
            ramp: 1.5,
            backoff: 0.5,
            patience: 2,
            noise_floor: 0.002,
            start: 0.01,
            warmup_max_step: usize::MAX,
        }
    }

    /// Observes `(lw, lr)` pairs in turn (10 steps apart, after the controller's evaluations
    /// so far); returns (phase, λ) after each.
    fn run_with(
        c: &mut LambdaController,
        traj: &[(f64, f64)],
        p: &LambdaParams,
    ) -> Vec<(Phase, f64)> {
        traj.iter()
            .map(|&(lw, lr)| {
                c.observe(lw, lr, 10 * c.evals, p);
                (c.phase, c.lambda)
            })
            .collect()
    }

    fn run(c: &mut LambdaController, traj: &[(f64, f64)]) -> Vec<(Phase, f64)> {
        run_with(c, traj, &params())
    }

    /// A small deterministic jitter in [-a, a].
    fn jitter(i: usize, a: f64) -> f64 {
        let x = ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64;
        (2.0 * x - 1.0) * a
    }

    /// SFT warm-up: lw rises fast, then flattens (with ±0.002 noise); lr follows lw.
    fn warmup_trajectory() -> Vec<(f64, f64)> {
        (0..16)
            .map(|i| {
                let lw = -1.0 - 1.5 * (-(i as f64) / 1.5).exp() + jitter(i, 0.002);
                (lw, lw - 0.3)
            })
            .collect()
    }

    /// A controller that left warm-up, with the states it went through.
    fn warmed_up() -> (LambdaController, Vec<(Phase, f64)>) {
        let mut c = LambdaController::new(&params());
        let states = run(&mut c, &warmup_trajectory());
        assert_eq!(c.phase, Phase::Ramp, "{states:?}");
        (c, states)
    }

    #[test]
    fn lambda_warmup_holds_min_until_lw_plateaus() {
        let (c, states) = warmed_up();
        // While lw still rises clearly, λ stays at the minimum.
        assert!(
            states[..4].iter().all(|s| *s == (Phase::Warmup, 0.01)),
            "{states:?}"
        );
        let first_ramp = states.iter().position(|s| s.0 == Phase::Ramp).unwrap();
        assert!(first_ramp >= 4, "{states:?}");
        // The threshold is measured from the warm-up changes, not just the floor.
        assert!(c.threshold >= 0.002 && c.threshold < 0.1, "{}", c.threshold);
    }

    #[test]
    fn lambda_ramps_on_a_healthy_trajectory() {
        let (mut c, _) = warmed_up();
        let (lw0, lr0) = (c.prev_lw, c.prev_lr);
        // lw flat (within noise) or rising, lr falling: the margin grows the healthy way.
        let traj: Vec<(f64, f64)> = (1..=12)
            .map(|i| {
                (
                    lw0 + 0.001 * i as f64 + jitter(100 + i, 0.001),
                    lr0 - 0.05 * i as f64,
                )
            })
            .collect();
        let before = c.lambda;
        let states = run(&mut c, &traj);
        assert!(states.iter().all(|s| s.0 == Phase::Ramp), "{states:?}");
        for w in states.windows(2) {
            assert!(
                w[1].1 >= w[0].1,
                "λ fell on a healthy trajectory: {states:?}"
            );
        }
        assert!(states[0].1 > before, "{states:?}");
        assert_eq!(c.lambda, 1.0, "λ reaches orpo_lambda_max: {states:?}");
    }

    #[test]
    fn lambda_backs_off_on_displacement() {
        let (mut c, _) = warmed_up();
        let (lw0, lr0) = (c.prev_lw, c.prev_lr);
        // Three healthy evaluations, then lw and lr both fall, lr faster: the margin rises.
        let mut traj = vec![(lw0, lr0 - 0.05), (lw0, lr0 - 0.1), (lw0, lr0 - 0.15)];
        for i in 1..=4 {
            traj.push((lw0 - 0.05 * i as f64, lr0 - 0.15 - 0.2 * i as f64));
        }
        let states = run(&mut c, &traj);
        let peak = states[2].1;
        assert_eq!(
            states[3],
            (Phase::Ramp, peak),
            "one displaced evaluation holds: {states:?}"
        );
        assert_eq!(states[4], (Phase::Backoff, peak * 0.5), "{states:?}");
        // Continued displacement backs off again.
        assert_eq!(states[6], (Phase::Backoff, peak * 0.25), "{states:?}");
        for w in traj.windows(2).skip(3) {
            assert!(w[1].0 - w[1].1 > w[0].0 - w[0].1, "the margin rises");
        }
        assert_eq!(c.backoffs, 2);
    }

    #[test]
    fn lambda_ramps_again_after_backoff_when_lw_recovers() {
        let (mut c, _) = warmed_up();
        let (lw0, lr0) = (c.prev_lw, c.prev_lr);
        // Displacement until λ is back at its minimum …
        let mut traj = Vec::new();
        for i in 1..=12 {
            traj.push((lw0 - 0.05 * i as f64, lr0 - 0.2 * i as f64));
        }
        let states = run(&mut c, &traj);
        assert_eq!(c.phase, Phase::Backoff, "{states:?}");
        assert_eq!(c.lambda, 0.01, "{states:?}");
        // … then lw recovers to its level: the ramp resumes.
        let (lw1, lr1) = (c.prev_lw, c.prev_lr);
        let rec: Vec<(f64, f64)> = (1..=6)
            .map(|i| ((lw1 + 0.15 * i as f64).min(lw0), lr1))
            .collect();
        let states = run(&mut c, &rec);
        assert!(states.iter().any(|s| s.0 == Phase::Ramp), "{states:?}");
        assert!(c.lambda > 0.01, "{states:?}");
    }

    #[test]
    fn lambda_leaves_the_floor_when_lw_settles_below_its_old_level() {
        let (mut c, _) = warmed_up();
        let (lw0, lr0) = (c.prev_lw, c.prev_lr);
        let mut traj = Vec::new();
        for i in 1..=4 {
            traj.push((lw0 - 0.05 * i as f64, lr0 - 0.2 * i as f64));
        }
        // lw stays 0.2 below its reference for good, but stops falling.
        for i in 0..6 {
            traj.push((lw0 - 0.2 + jitter(200 + i, 0.001), lr0 - 0.8));
        }
        let states = run(&mut c, &traj);
        assert!(
            states[..4].iter().any(|s| s.0 == Phase::Backoff),
            "{states:?}"
        );
        assert_eq!(c.phase, Phase::Ramp, "{states:?}");
    }

    #[test]
    fn lambda_hysteresis_one_noisy_evaluation_does_not_flip_the_phase() {
        // In warm-up: a single flat evaluation among rising ones does not end it.
        let mut c = LambdaController::new(&params());
        let traj = [
            (-3.0, -3.3),
            (-2.5, -2.8),
            (-2.0, -2.3),
            (-1.5, -1.8),
            (-1.5, -1.8),
            (-1.0, -1.3),
            (-0.5, -0.8),
        ];
        let states = run(&mut c, &traj);
        assert!(states.iter().all(|s| s.0 == Phase::Warmup), "{states:?}");
        // In the ramp: a single displaced evaluation holds λ, the next healthy one ramps on.
        let (mut c, _) = warmed_up();
        let (lw0, lr0) = (c.prev_lw, c.prev_lr);
        let traj = [
            (lw0, lr0 - 0.05),
            (lw0 - 0.1, lr0 - 0.3),
            (lw0, lr0 - 0.35),
            (lw0, lr0 - 0.4),
        ];
        let states = run(&mut c, &traj);
        assert!(states.iter().all(|s| s.0 == Phase::Ramp), "{states:?}");
        assert_eq!(states[1].1, states[0].1, "{states:?}");
        assert!(states[2].1 > states[1].1, "{states:?}");
        assert_eq!(c.backoffs, 0);
    }

    #[test]
    fn lambda_warmup_ends_at_its_limit_while_lw_still_rises() {
        // SFT still gaining at every evaluation (the short run's case): no plateau ever.
        let p = LambdaParams {
            start: 0.1,
            warmup_max_step: 12,
            ..params()
        };
        let traj: Vec<(f64, f64)> = (0..12)
            .map(|i| {
                let lw = -3.0 + 0.2 * i as f64 + jitter(300 + i, 0.003);
                (lw, lw - 0.5 - 0.1 * i as f64)
            })
            .collect();
        let mut c = LambdaController::new(&p);
        let states = run_with(&mut c, &traj, &p);
        // Evaluations at steps 0 and 10 are in warm-up; the one at 20 (≥ 12) ends it at the
        // static λ, and healthy evaluations ramp it from there to the maximum.
        assert_eq!(states[0], (Phase::Warmup, 0.01), "{states:?}");
        assert_eq!(states[1], (Phase::Warmup, 0.01), "{states:?}");
        assert_eq!(states[2], (Phase::Ramp, 0.1), "{states:?}");
        assert!(states[3].1 > 0.1, "{states:?}");
        assert_eq!(c.lambda, 1.0, "{states:?}");
        assert!(
            c.threshold >= 0.002 && c.threshold < 0.05,
            "{}",
            c.threshold
        );
    }

    #[test]
    fn lambda_state_round_trips_exactly() {
        let (mut c, _) = warmed_up();
        run(&mut c, &[(-1.0 / 3.0, -0.7), (0.1 + 0.2, -0.9)]);
        let json = serde_json::to_string(&c).unwrap();
        let back: LambdaController = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.lambda.to_bits(), c.lambda.to_bits());
        assert_eq!(back.prev_lw.to_bits(), c.prev_lw.to_bits());
    }
}
