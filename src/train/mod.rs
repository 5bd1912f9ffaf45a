//! Training: objectives, the logp head, the optimiser and the loop.

pub mod objectives;
