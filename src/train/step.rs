//! One example through the model: forward every sequence of its plan, read per-token logps of each
//! branch through the logp engine, apply the objective, and (when training) send d logp back
//! through the head and the layers into the LoRA gradients.

use super::device_loss::{self, ExampleScale, Parts, PendingLoss, Reference};
use super::head::{
    concat_vectors, logp_backward_saved, logp_forward_saved, slice_vector, HeadSaved, HeadTier,
};
use super::plan::{Plan, Rows, Sequence};
use crate::model::{ForwardPlan, Lora, Model, PassCtx};
use crate::tensor::{self as ops, RopeTable, Tensor};
use anyhow::{anyhow, ensure, Result};

pub use super::objectives::Objective;

#[derive(Clone, Copy, Debug)]
pub struct PassOptions {
    pub segment_size: usize,
    /// With segments: keep each layer's attention output from the forward instead of
    /// recomputing it (`Model::forward_keeping`).
    pub keep_attention: bool,
    /// With segments: layers whose k and v stay from the forward (`ForwardPlan`).
    pub keep_kv_layers: usize,
    /// MLP token chunk (`ForwardPlan::mlp_chunk`).
    pub mlp_chunk: usize,
    /// With segments: layer boundaries in host memory (`ForwardPlan::offload`).
    pub offload: bool,
    /// With segments: each segment recomputed layer by layer (`ForwardPlan::nested`).
    pub nested: bool,
    /// With offload: layers whose boundaries and kept tensors stay on the device
    /// (`ForwardPlan::resident_layers`).
    pub resident_layers: usize,
    /// With segments: layers below the top that keep all their activations
    /// (`ForwardPlan::full_layers`).
    pub full_layers: usize,
    pub head: HeadTier,
    pub head_chunk: usize,
    pub dropout: Option<(f32, u64)>,
}

pub struct ExampleOut {
    pub loss: f64,
    pub metrics: Vec<(&'static str, f64)>,
    pub tokens: usize,
}

/// An example whose objective (and, when training, backward) is queued on the device;
/// `finish` reads the loss and metrics back.
pub struct QueuedExample {
    loss: PendingLoss,
    tokens: usize,
}

impl QueuedExample {
    /// Waits for the objective's sums (a sync point on CUDA) and evaluates loss and metrics.
    pub fn finish(self) -> Result<ExampleOut> {
        let (loss, metrics) = self.loss.finish()?;
        Ok(ExampleOut {
            loss,
            metrics: metrics.pairs(),
            tokens: self.tokens,
        })
    }
}

/// The response logps under the base model (adapter off), reduced on the device: DPO's
/// reference, computed once per example without gradients.
pub fn reference_logps(model: &Model, plan: &Plan, opts: &PassOptions) -> Result<Reference> {
    let rej = plan
        .rejected
        .as_ref()
        .ok_or_else(|| anyhow!("DPO needs a preference example"))?;
    let empty = Rows::default();
    let groups = head_groups(
        plan.seqs.len(),
        &[&empty, &plan.chosen.response, &rej.response],
    );
    let mut fwd = forward_all(model, plan, None, opts, false, &groups)?;
    let head = head_pass(model, &mut fwd, &groups, opts, false)?;
    device_loss::reference(&head.logp, &head.parts(true))
}

/// Rows of one sequence read by the head, with where each branch's part lies in them.
struct HeadGroup {
    seq: usize,
    rows: Vec<u32>,
    targets: Vec<u32>,
    /// `(part index, start, len)`.
    spans: Vec<(usize, usize, usize)>,
}

impl HeadGroup {
    /// The group's rows counted from row `from` of its sequence.
    fn local_rows(&self, from: usize) -> Vec<u32> {
        self.rows.iter().map(|&r| r - from as u32).collect()
    }
}

fn head_groups(n_seqs: usize, parts: &[&Rows]) -> Vec<HeadGroup> {
    let mut groups = Vec::new();
    for seq in 0..n_seqs {
        let mut g = HeadGroup {
            seq,
            rows: Vec::new(),
            targets: Vec::new(),
            spans: Vec::new(),
        };
        for (i, r) in parts.iter().enumerate() {
            if r.seq == seq && !r.rows.is_empty() {
                g.spans.push((i, g.rows.len(), r.rows.len()));
                g.rows.extend(&r.rows);
                g.targets.extend(&r.targets);
            }
        }
        if !g.rows.is_empty() {
            groups.push(g);
        }
    }
    groups
}

/// The first row of sequence `seq` that any head group reads (0 when none does): the forward
/// computes the final hidden states from there on (`Model::forward_keeping`).
fn first_read_row(groups: &[HeadGroup], seq: usize) -> usize {
    groups
        .iter()
        .filter(|g| g.seq == seq)
        .flat_map(|g| g.rows.iter().copied())
        .min()
        .unwrap_or(0) as usize
}

/// `memory::keep_top_mlp` for a head over `rows` rows with these options.
fn keep_top_mlp(model: &Model, rows: usize, opts: &PassOptions) -> bool {
    let c = model.device.compute_dtype().size();
    let vocab = model.spec.vocab;
    // Logits in f32 with their softmax coefficients for the rows the head holds at once; the
    // fused tier holds an f32 d(hidden) accumulator instead.
    let head_bytes = match opts.head {
        HeadTier::Full => rows * vocab * (4 + c),
        HeadTier::Chunked => opts.head_chunk.min(rows) * vocab * (4 + c),
        HeadTier::Fused => rows * model.spec.hidden * 4,
    };
    super::memory::keep_top_mlp(&model.spec, rows, head_bytes, c)
}

/// One sequence after the forward: final hidden states of rows `[read_from, T)`, what the
/// backward needs (when kept), and the RoPE table, built once and reused by the backward.
struct Forwarded {
    /// Released once the head has gathered its rows (`head_pass`).
    hidden: Option<Tensor>,
    /// Rows of `hidden`.
    rows: usize,
    read_from: usize,
    state: Option<crate::model::runner::ForwardState>,
    rope: RopeTable,
}

fn forward_all(
    model: &Model,
    plan: &Plan,
    lora: Option<&Lora>,
    opts: &PassOptions,
    keep: bool,
    groups: &[HeadGroup],
) -> Result<Vec<Forwarded>> {
    // LongRoPE picks its factors by the example's largest position over all its sequences, as a
    // padded batch of chosen and rejected does in transformers: the same for one prefix-shared
    // sequence and for two.
    let max_pos = plan
        .seqs
        .iter()
        .flat_map(|s| s.mask.positions.iter().copied())
        .max()
        .unwrap_or(0);
    plan.seqs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let rope = model.rope_table_at(&s.mask.positions, max_pos)?;
            let ctx = PassCtx {
                mask: &s.mask,
                rope: &rope,
                dropout: opts.dropout,
            };
            // Without a backward, keep only the first boundary: no activations stay live.
            let seg = if keep {
                opts.segment_size
            } else {
                model.spec.n_layers
            };
            let read_from = first_read_row(groups, i);
            let plan = ForwardPlan {
                segment_size: seg,
                keep_attention: keep && opts.keep_attention,
                keep_top_mlp: keep_top_mlp(model, s.ids.len() - read_from, opts),
                read_from,
                keep_kv_layers: if keep { opts.keep_kv_layers } else { 0 },
                mlp_chunk: opts.mlp_chunk,
                offload: keep && opts.offload,
                nested: keep && opts.nested,
                resident_layers: opts.resident_layers,
                full_layers: if keep { opts.full_layers } else { 0 },
            };
            let (hidden, st) = model.forward_keeping(&s.ids, lora, &ctx, plan)?;
            Ok(Forwarded {
                rows: hidden.dim(0),
                hidden: Some(hidden),
                read_from,
                state: keep.then_some(st),
                rope,
            })
        })
        .collect()
}

/// The head over every group: the logps of all groups end to end, where each part lies in them,
/// and each group's gathered rows and saved state for the backward.
struct HeadPass {
    logp: Tensor,
    spans: [(usize, usize); 3],
    groups: Vec<(Tensor, HeadSaved)>,
}

impl HeadPass {
    fn parts(&self, preference: bool) -> Parts {
        Parts {
            chosen_prompt: self.spans[0],
            chosen_response: self.spans[1],
            rejected_response: preference.then_some(self.spans[2]),
        }
    }
}

/// Gathers every group's rows, then releases the hidden states (nothing else reads them) before
/// the head's chunks allocate their logits.
fn head_pass(
    model: &Model,
    fwd: &mut [Forwarded],
    groups: &[HeadGroup],
    opts: &PassOptions,
    train: bool,
) -> Result<HeadPass> {
    ensure!(
        !groups.is_empty(),
        "the example has no token the head reads"
    );
    let gathered = groups
        .iter()
        .map(|g| {
            let f = &fwd[g.seq];
            let hidden = f
                .hidden
                .as_ref()
                .ok_or_else(|| anyhow!("the head reads hidden states already released"))?;
            ops::gather_rows(hidden, &g.local_rows(f.read_from))
        })
        .collect::<Result<Vec<_>>>()?;
    for f in fwd.iter_mut() {
        f.hidden = None;
    }
    let mut spans = [(0, 0); 3];
    let mut logps = Vec::with_capacity(groups.len());
    let mut saved = Vec::with_capacity(groups.len());
    let mut offset = 0;
    for (g, h) in groups.iter().zip(gathered) {
        let (lp, s) = logp_forward_saved(model, &h, &g.targets, opts.head, opts.head_chunk, train)?;
        for &(part, start, len) in &g.spans {
            spans[part] = (offset + start, len);
        }
        offset += g.rows.len();
        logps.push(lp);
        saved.push((h, s));
    }
    Ok(HeadPass {
        logp: concat_vectors(logps)?,
        spans,
        groups: saved,
    })
}

/// Runs one example; with `train`, accumulates its LoRA gradients (scaled by `grad_weight`).
/// Forward, head, objective and backward are queued on the device and nothing waits for it:
/// `QueuedExample::finish` reads the loss and metrics back. The loss is unweighted and unclipped
/// ([`queue_example_scaled`] applies an example's weight and the loss clip).
#[allow(clippy::too_many_arguments)]
pub fn queue_example(
    model: &Model,
    lora: &mut Lora,
    plan: &Plan,
    objective: &Objective,
    reference: Option<&Reference>,
    opts: &PassOptions,
    train: bool,
    grad_weight: f32,
) -> Result<QueuedExample> {
    queue_example_scaled(
        model,
        lora,
        plan,
        objective,
        reference,
        opts,
        train,
        grad_weight,
        ExampleScale::default(),
    )
}

/// [`queue_example`] with the example's weight and the loss clip (`device_loss::ExampleScale`):
/// the loss and the gradient are the scaled ones, the metrics unscaled.
#[allow(clippy::too_many_arguments)]
pub fn queue_example_scaled(
    model: &Model,
    lora: &mut Lora,
    plan: &Plan,
    objective: &Objective,
    reference: Option<&Reference>,
    opts: &PassOptions,
    train: bool,
    grad_weight: f32,
    scale: ExampleScale,
) -> Result<QueuedExample> {
    let empty = Rows::default();
    let chosen_prompt = if objective.needs_prompt() {
        &plan.chosen.prompt
    } else {
        &empty
    };
    let rejected = plan.rejected.as_ref().map_or(&empty, |b| &b.response);
    // The head runs once per sequence over every row any part reads from it: one gather and one
    // pass through the logp engine per sequence.
    let groups = head_groups(
        plan.seqs.len(),
        &[chosen_prompt, &plan.chosen.response, rejected],
    );
    let mut fwd = forward_all(model, plan, Some(lora), opts, train, &groups)?;
    model.device.memtrace(|| "forward done".into());
    let head = head_pass(model, &mut fwd, &groups, opts, train)?;
    model.device.memtrace(|| "head forward".into());
    let parts = head.parts(plan.rejected.is_some());
    let (loss, dlogp) =
        device_loss::evaluate(&head.logp, &parts, objective, reference, grad_weight, scale)?;

    if train {
        backward_all(model, lora, &plan.seqs, fwd, &groups, head, &dlogp, opts)?;
    }
    Ok(QueuedExample {
        loss,
        tokens: plan.tokens(),
    })
}

/// Gradients from `d loss / d logp` into each sequence's hidden states, then back through the
/// layers into the LoRA gradients.
#[allow(clippy::too_many_arguments)]
fn backward_all(
    model: &Model,
    lora: &mut Lora,
    seqs: &[Sequence],
    mut fwd: Vec<Forwarded>,
    groups: &[HeadGroup],
    head: HeadPass,
    dlogp: &Tensor,
    opts: &PassOptions,
) -> Result<()> {
    let mut dh: Vec<Option<Tensor>> = (0..seqs.len()).map(|_| None).collect();
    let mut offset = 0;
    for (g, (h, saved)) in groups.iter().zip(head.groups) {
        let d = slice_vector(dlogp, offset, offset + g.rows.len())?;
        offset += g.rows.len();
        let dhc =
            logp_backward_saved(model, &h, &g.targets, &d, opts.head, opts.head_chunk, saved)?;
        let shape = [fwd[g.seq].rows, dhc.dim(1)];
        let mut slot = Tensor::zeros(&shape, dhc.dtype(), dhc.device())?;
        ops::scatter_add_rows(&mut slot, &g.local_rows(fwd[g.seq].read_from), &dhc)?;
        dh[g.seq] = Some(slot);
    }
    model.device.memtrace(|| "head backward".into());
    for (i, s) in seqs.iter().enumerate().rev() {
        let (Some(d), Some(state)) = (dh[i].take(), fwd[i].state.take()) else {
            continue;
        };
        let ctx = PassCtx {
            mask: &s.mask,
            rope: &fwd[i].rope,
            dropout: opts.dropout,
        };
        model.backward(d, state, Some(lora), &ctx)?;
    }
    Ok(())
}

/// One example of a pack (`queue_packed`): its plan (one sequence), its DPO reference and its
/// weight and loss clip.
pub struct PackMember<'a> {
    pub plan: &'a Plan,
    pub reference: Option<&'a Reference>,
    pub scale: ExampleScale,
}

/// Runs several examples as one packed sequence (`plan::pack`): one forward, one head pass over
/// every member's rows, each member's objective on its own rows, one backward of the summed
/// gradient. Each member's loss and gradient are those of `queue_example_scaled` on it alone
/// (f32 sums in another order). Not for models whose rotary factors depend on the example's
/// largest position (LongRoPE): a pack's would be its longest member's.
#[allow(clippy::too_many_arguments)]
pub fn queue_packed(
    model: &Model,
    lora: &mut Lora,
    members: &[PackMember],
    objective: &Objective,
    opts: &PassOptions,
    train: bool,
    grad_weight: f32,
) -> Result<Vec<QueuedExample>> {
    ensure!(!members.is_empty(), "an empty pack");
    ensure!(
        !model.spec.ropes[0].depends_on_length(),
        "packing: this model's rotary factors depend on the example's length (LongRoPE); train \
         it without pack_tokens"
    );
    let plans: Vec<&Plan> = members.iter().map(|m| m.plan).collect();
    let packed = super::plan::pack(&plans)?;
    // One head group over every member's rows, member by member, and where each part lies.
    let mut group = HeadGroup {
        seq: 0,
        rows: Vec::new(),
        targets: Vec::new(),
        spans: Vec::new(),
    };
    let mut member_parts = Vec::with_capacity(members.len());
    for (m, &offset) in members.iter().zip(&packed.offsets) {
        let empty = Rows::default();
        let prompt = if objective.needs_prompt() {
            &m.plan.chosen.prompt
        } else {
            &empty
        };
        let rejected = m.plan.rejected.as_ref().map(|b| &b.response);
        let mut span = |r: &Rows| {
            let r = super::plan::shifted(r, offset);
            let s = (group.rows.len(), r.rows.len());
            group.rows.extend(&r.rows);
            group.targets.extend(&r.targets);
            s
        };
        let chosen_prompt = span(prompt);
        let chosen_response = span(&m.plan.chosen.response);
        let rejected_response = rejected.map(&mut span);
        member_parts.push(Parts {
            chosen_prompt,
            chosen_response,
            rejected_response,
        });
    }
    let groups = [group];
    let plan = Plan {
        seqs: vec![packed.seq],
        chosen: super::plan::Branch {
            prompt: Rows::default(),
            response: Rows::default(),
        },
        rejected: None,
    };
    let mut fwd = forward_all(model, &plan, Some(lora), opts, train, &groups)?;
    let head = head_pass(model, &mut fwd, &groups, opts, train)?;
    let mut queued = Vec::with_capacity(members.len());
    let mut dlogp: Option<Tensor> = None;
    for (m, parts) in members.iter().zip(&member_parts) {
        let (loss, d) = device_loss::evaluate(
            &head.logp,
            parts,
            objective,
            m.reference,
            grad_weight,
            m.scale,
        )?;
        // Each member's gradient is zero outside its own rows: the sum is every member's.
        match dlogp.as_mut() {
            None => dlogp = Some(d),
            Some(sum) => ops::add_assign(sum, &d, 1.0)?,
        }
        queued.push(QueuedExample {
            loss,
            tokens: m.plan.tokens(),
        });
    }
    if train {
        let dlogp = dlogp.expect("a pack has members");
        backward_all(model, lora, &plan.seqs, fwd, &groups, head, &dlogp, opts)?;
    }
    Ok(queued)
}
