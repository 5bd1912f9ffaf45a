//! Whole-model parity against PyTorch: tiny random Llama, Qwen2, Qwen3, Mistral, MiniCPM5-shaped
//! Llama, Gemma 2, Gemma 3 and MiniCPM (tied with LongRoPE, untied) models with LoRA on all seven
//! projections (non-zero B), fixtures made by scripts/make_model_fixtures.py.
//!
//! MiniCPM's `h / (hidden/dim_model_base)` is folded into lorafit's final norm, so its final
//! hidden states are the fixture's `hidden` times `head_input_scale` (and d(hidden) the
//! fixture's divided by it).
//! Logits within max|diff| ≤ 1e-4·max|logit| and every LoRA gradient within relative-norm error
//! ≤ 1e-4, both from d(logits) and from d(hidden); all on the CPU in f32.

mod common;
use common::*;
use lorafit::model::weights::{load_weights, SafetensorsFolder};
use lorafit::model::{lora::peft_key, ForwardPlan, Lora, Model, ModelSpec, PassCtx};
use lorafit::tensor::{Device, Tensor};

fn run_family(name: &str) {
    let dir = fixture(&format!("models/{name}"));
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let spec = ModelSpec::from_config_file(&dir.join("config.json")).unwrap();
    let dev = Device::Cpu;
    let src = SafetensorsFolder::open(&dir).unwrap();
    let weights = load_weights(&spec, &src, &dev).unwrap();
    let model = Model::new(spec.clone(), weights, dev.clone());
    let mut lora = Lora::load_peft(&dir.join("adapter"), &spec, &dev).unwrap();

    let ids: Vec<u32> = reference["input_ids"].1.iter().map(|&x| x as u32).collect();
    let t = ids.len();
    let (inv_shape, inv_ref) = &reference["rope_inv_freq"];
    assert_eq!(inv_shape[0], spec.head_dim / 2);
    // The table a T-token pass uses (LongRoPE's long factors past the original context).
    assert_close(
        &format!("{name} inv_freq"),
        &spec.ropes[0].inv_freq(t - 1),
        inv_ref,
        1e-6,
    );
    if let Some((_, global)) = reference.get("rope_inv_freq_global") {
        assert_close(
            &format!("{name} global inv_freq"),
            &spec.ropes[1].inv_freq(t - 1),
            global,
            1e-6,
        );
    }
    if let Some((_, local)) = reference.get("rope_inv_freq_local") {
        assert_close(
            &format!("{name} local inv_freq"),
            &spec.ropes[1].inv_freq(t - 1),
            local,
            1e-6,
        );
    }
    if let Some((_, f)) = reference.get("rope_attention_factor") {
        let got = spec.ropes[0].attention_factor();
        assert!(
            (got - f[0]).abs() <= 1e-6,
            "{name}: attention factor {got} vs {}",
            f[0]
        );
    }
    if let Some((_, s)) = reference.get("embed_scale") {
        assert_eq!(spec.embed_scale, Some(s[0]), "{name}: embedding scale");
    }
    let hscale = spec.head_input_scale.unwrap_or(1.0);
    let hidden_ref: Vec<f32> = reference["hidden"].1.iter().map(|x| x * hscale).collect();
    let dhidden_ref: Vec<f32> = reference["dhidden"].1.iter().map(|x| x / hscale).collect();
    let mask = model.causal_mask(t);
    let rope = model.rope_table(&mask.positions).unwrap();
    let ctx = PassCtx {
        mask: &mask,
        rope: &rope,
        dropout: None,
    };

    for seg in [0usize, 1] {
        // From d(logits).
        lora.zero_grads().unwrap();
        let (hidden, state) = model.forward(&ids, Some(&lora), &ctx, seg).unwrap();
        let logits = model.logits(&hidden, lorafit::tensor::DType::F32).unwrap();
        let want = &reference["logits"].1;
        let (md, i) = max_diff(logits.as_cpu().unwrap(), want);
        let bound = 1e-4 * max_abs(want);
        assert!(
            md <= bound,
            "{name}: logits max|diff| {md:.3e} at {i} > {bound:.3e}"
        );
        assert_close(
            &format!("{name} hidden"),
            hidden.as_cpu().unwrap(),
            &hidden_ref,
            1e-5,
        );
        let dlogits = Tensor::cpu(reference["dlogits"].1.clone(), &[t, spec.vocab]).unwrap();
        let dh = model.logits_bwd_capped(&dlogits, &logits).unwrap();
        model.backward(dh, state, Some(&mut lora), &ctx).unwrap();
        check_grads(name, "grad_logits", &lora, &reference);

        // From d(hidden).
        lora.zero_grads().unwrap();
        let (_, state) = model.forward(&ids, Some(&lora), &ctx, seg).unwrap();
        let dh = Tensor::cpu(dhidden_ref.clone(), &[t, spec.hidden]).unwrap();
        model.backward(dh, state, Some(&mut lora), &ctx).unwrap();
        check_grads(name, "grad_hidden", &lora, &reference);
    }

    // Computing only rows [r, T) of the final hidden states (`Model::forward_keeping`'s
    // `read_from`, as the trainer does when the head reads a suffix) gives those rows and every
    // gradient of the full pass whose d(hidden) is zero before row r.
    let r = t / 2 + 1;
    let dh_full = dhidden_ref.clone();
    let mut dh_zeroed = dh_full.clone();
    dh_zeroed[..r * spec.hidden].fill(0.0);
    for seg in [0usize, 1] {
        lora.zero_grads().unwrap();
        let (hidden, state) = model.forward(&ids, Some(&lora), &ctx, seg).unwrap();
        let hidden_full = hidden.as_cpu().unwrap()[r * spec.hidden..].to_vec();
        let dh = Tensor::cpu(dh_zeroed.clone(), &[t, spec.hidden]).unwrap();
        let d_embed_full = model.backward(dh, state, Some(&mut lora), &ctx).unwrap();
        let grads_full: Vec<Vec<f32>> = lora
            .pairs()
            .flat_map(|(_, _, p)| [p.grad_a.to_vec().unwrap(), p.grad_b.to_vec().unwrap()])
            .collect();

        lora.zero_grads().unwrap();
        let plan = ForwardPlan {
            segment_size: seg,
            keep_attention: seg > 0,
            keep_top_mlp: false,
            read_from: r,
            keep_kv_layers: seg,
            mlp_chunk: 0,
            offload: seg == 2,
            nested: seg > 1,
            resident_layers: 0,
            full_layers: usize::from(seg == 1),
        };
        let (hidden, state) = model
            .forward_keeping(&ids, Some(&lora), &ctx, plan)
            .unwrap();
        assert_eq!(hidden.shape(), &[t - r, spec.hidden]);
        let what = format!("{name} seg {seg} rows from {r}");
        assert_close(
            &format!("{what} hidden"),
            hidden.as_cpu().unwrap(),
            &hidden_full,
            1e-6,
        );
        let dh = Tensor::cpu(dh_full[r * spec.hidden..].to_vec(), &[t - r, spec.hidden]).unwrap();
        let d_embed = model.backward(dh, state, Some(&mut lora), &ctx).unwrap();
        assert_close(
            &format!("{what} d(embeddings)"),
            d_embed.as_cpu().unwrap(),
            d_embed_full.as_cpu().unwrap(),
            1e-6,
        );
        let grads: Vec<Vec<f32>> = lora
            .pairs()
            .flat_map(|(_, _, p)| [p.grad_a.to_vec().unwrap(), p.grad_b.to_vec().unwrap()])
            .collect();
        assert_eq!(grads.len(), 2 * lora.pairs().count());
        for (i, (g, want)) in grads.iter().zip(&grads_full).enumerate() {
            assert!(
                want.iter().any(|&v| v != 0.0),
                "{what}: gradient {i} is all zero"
            );
            assert_close(&format!("{what} gradient {i}"), g, want, 1e-6);
        }
    }

    // The base model alone (adapter off).
    let (hidden, _) = model.forward(&ids, None, &ctx, 0).unwrap();
    let logits = model.logits(&hidden, lorafit::tensor::DType::F32).unwrap();
    let want = &reference["base_logits"].1;
    let (md, _) = max_diff(logits.as_cpu().unwrap(), want);
    assert!(
        md <= 1e-4 * max_abs(want),
        "{name}: base logits max|diff| {md:.3e}"
    );
}

fn check_grads(
    name: &str,
    prefix: &str,
    lora: &Lora,
    reference: &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>,
) {
    let mut n = 0;
    for (l, t, p) in lora.pairs() {
        for (is_b, g) in [(false, &p.grad_a), (true, &p.grad_b)] {
            let key = format!("{prefix}.{}", peft_key(l, t, is_b));
            let (shape, want) = reference
                .get(&key)
                .unwrap_or_else(|| panic!("{name}: reference lacks {key}"));
            assert_eq!(shape.as_slice(), g.shape(), "{name}: {key} shape");
            assert_close(&format!("{name} {key}"), g.as_cpu().unwrap(), want, 1e-4);
            n += 1;
        }
    }
    // Every reference gradient is one of the adapter's (KV-sharing layers have no k/v adapters).
    let want = reference
        .keys()
        .filter(|k| k.starts_with(&format!("{prefix}.")))
        .count();
    assert_eq!(
        n, want,
        "{name}: {n} adapter gradients, the reference has {want}"
    );
}

#[test]
fn llama_matches_pytorch() {
    run_family("llama");
}
#[test]
fn llama_linear_rope_tied_matches_pytorch() {
    run_family("llama_linear");
}
#[test]
fn qwen2_rslora_rank_pattern_matches_pytorch() {
    run_family("qwen2");
}
#[test]
fn qwen3_matches_pytorch() {
    run_family("qwen3");
}
#[test]
fn mistral_sliding_window_matches_pytorch() {
    run_family("mistral");
}
#[test]
fn minicpm5_llama_explicit_head_dim_matches_pytorch() {
    run_family("minicpm5");
}
#[test]
fn gemma2_softcaps_sandwich_window_matches_pytorch() {
    run_family("gemma2");
}
#[test]
fn gemma3_qk_norm_local_global_rope_matches_pytorch() {
    run_family("gemma3");
}
#[test]
fn gemma4_kv_sharing_per_layer_inputs_proportional_rope_matches_pytorch() {
    run_family("gemma4");
}
#[test]
fn gemma4_k_eq_v_global_kv_heads_matches_pytorch() {
    run_family("gemma4_keqv");
}
#[test]
fn minicpm_mup_longrope_tied_matches_pytorch() {
    run_family("minicpm");
}
#[test]
fn minicpm_untied_matches_pytorch() {
    run_family("minicpm_untied");
}

/// A `Gemma3ForConditionalGeneration` checkpoint (the text model's config under `text_config`,
/// its weights under `model.language_model.` as transformers ≥ 4.52 saves them, or under
/// `language_model.model.` as older ones did, plus vision weights that are not loaded) gives the
/// text model's logits.
#[test]
fn gemma3_multimodal_checkpoint_loads_its_language_model() {
    let dir = fixture("models/gemma3");
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let weights = read_safetensors(&dir.join("model.safetensors"));
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let ids: Vec<u32> = reference["input_ids"].1.iter().map(|&x| x as u32).collect();
    for new_layout in [true, false] {
        let out = std::env::temp_dir().join(format!(
            "lorafit-gemma3-multimodal-{}-{new_layout}",
            std::process::id()
        ));
        std::fs::create_dir_all(&out).unwrap();
        let config = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8},
        });
        std::fs::write(out.join("config.json"), config.to_string()).unwrap();
        let prefix = if new_layout {
            "model.language_model."
        } else {
            "language_model.model."
        };
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = weights
            .iter()
            .map(|(k, (s, d))| {
                let leaf = k.strip_prefix("model.").unwrap_or(k);
                (format!("{prefix}{leaf}"), s.clone(), d.clone())
            })
            .collect();
        tensors.push((
            "model.vision_tower.patch_embed.weight".into(),
            vec![8, 3],
            vec![0.5; 24],
        ));
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        lorafit::model::weights::write_f32_safetensors(&out.join("model.safetensors"), &tensors)
            .unwrap();
        let mm = lorafit::model::load(&out, &Device::Cpu).unwrap();
        let plain = lorafit::model::load(&dir, &Device::Cpu).unwrap();
        let dtype = lorafit::tensor::DType::F32;
        let got = mm
            .logits(&mm.hidden_states(&ids, None).unwrap(), dtype)
            .unwrap();
        let want = plain
            .logits(&plain.hidden_states(&ids, None).unwrap(), dtype)
            .unwrap();
        let (md, _) = max_diff(got.as_cpu().unwrap(), want.as_cpu().unwrap());
        assert_eq!(md, 0.0, "layout new={new_layout}: logits differ by {md}");
        let _ = std::fs::remove_dir_all(&out);
    }
}
