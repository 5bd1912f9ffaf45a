//! SmolLM2-135M-Instruct (Q4_1 GGUF): loads, and its logits on a fixed sequence match transformers
//! run on the same dequantized weights (scripts/make_smollm2_fixture.py) within relative-norm error
//! 1e-3. Skipped, with a `SKIPPED` line in the test output, where the model is not cached (the CI
//! script fetches it first and then requires it).

mod common;
use common::*;
use lorafit::tensor::{DType, Device};

#[test]
fn smollm2_logits_match_transformers() {
    let Some(path) = smollm2_or_skip("smollm2_logits_match_transformers") else {
        return;
    };
    let model = lorafit::model::load(&path, &Device::Cpu).unwrap();
    assert_eq!(
        (model.spec.n_layers, model.spec.hidden, model.spec.vocab),
        (30, 576, 49152)
    );
    assert!(model.spec.tie_embeddings);
    let reference = read_safetensors(&fixture("smollm2/reference.safetensors"));
    let ids: Vec<u32> = reference["input_ids"].1.iter().map(|&x| x as u32).collect();
    let hidden = model.hidden_states(&ids, None).unwrap();
    let logits = model.logits(&hidden, DType::F32).unwrap().to_vec().unwrap();
    let v = model.spec.vocab;
    let tail = &logits[(ids.len() - 4) * v..];
    assert_close(
        "smollm2 logits (last 4 positions)",
        tail,
        &reference["logits_tail"].1,
        1e-3,
    );
}
