//! The project's one seedable generator (SplitMix64): LoRA initialisation, random base weights
//! for benchmarks and tests, data shuffling and dropout draw from it, so every run is
//! reproducible from its seed without a dependency.

use serde::{Deserialize, Serialize};

/// SplitMix64.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// A Fisher-Yates permutation of `0..n` (the data order of an epoch, a held-out split).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }
    /// `k` of `n` positions, marked true: the first `k` of `permutation(n)` (a seeded held-out
    /// split that keeps every other row in place and in order).
    pub fn choose(&mut self, n: usize, k: usize) -> Vec<bool> {
        let order = self.permutation(n);
        let mut chosen = vec![false; n];
        for &i in &order[..k.min(n)] {
            chosen[i] = true;
        }
        chosen
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}
