//! Training: objectives, the logp head, the optimiser and the loop.

pub mod device_loss;
pub mod events;
pub mod head;
pub mod lambda_controller;
pub mod listeners;
pub mod memory;
pub mod objectives;
pub mod optim;
pub mod plan;
pub mod rank_scaling;
pub mod run_folder;
pub mod step;
pub mod tfevents;
pub mod trainer;
