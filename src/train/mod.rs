//! Training: objectives, the logp head, the optimiser and the loop.

pub mod objectives;
pub mod head;
pub mod plan;
pub mod step;
pub mod optim;
pub mod trainer;
