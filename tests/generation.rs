//! Generation with the KV cache against the uncached forward, on the CPU: on every family fixture
//! (tests/fixtures/models, LoRA on all seven projections) the cached next-token logits equal the
//! whole-sequence forward's at every step (max|diff| ≤ 1e-4·max|logit|, the model-parity bound)
//! through windows shorter than the sequence and MiniCPM's switch to LongRoPE's long factors, and
//! greedy generation matches token for token, alone, batched, and after a chat turn extends a
//! cached sequence; SmolLM2 the same where it is cached. Gemma 4 (per-layer head_dim and kv
//! heads, KV-sharing layers reading their donor's cache, v norm, k = v, proportional RoPE,
//! per-layer inputs and layer scalars) is among the families. The chat path's ids are the
//! template's own rendering with one bos; the decode-attention op equals the full attention's
//! rows; sampling is reproducible from its seed and its filters keep what they should; a
//! sequence keeps to the model's context.

mod common;
use common::*;
use lorafit::data::{ChatTemplate, Message, TextTokenizer};
use lorafit::infer::sample::{apply_repetition_penalty, candidates, Sampler};
use lorafit::infer::{self, Decoder, GenerateOptions, Sampling, StopReason};
use lorafit::model::weights::{load_weights, SafetensorsFolder};
use lorafit::model::{Lora, Model, ModelSpec};
use lorafit::tensor::{self as ops, AttnMask, AttnShape, DType, Device, Tensor};

const FAMILIES: [&str; 12] = [
    "llama",
    "llama_linear",
    "mistral",
    "qwen2",
    "qwen3",
    "minicpm",
    "minicpm5",
    "minicpm_untied",
    "gemma2",
    "gemma3",
    "gemma4",
    "gemma4_keqv",
];

fn load_family(name: &str) -> (Model, Lora) {
    let dir = fixture(&format!("models/{name}"));
    let spec = ModelSpec::from_config_file(&dir.join("config.json")).unwrap();
    let dev = Device::Cpu;
    let src = SafetensorsFolder::open(&dir).unwrap();
    let weights = load_weights(&spec, &src, &dev).unwrap();
    let model = Model::new(spec.clone(), weights, dev.clone());
    let lora = Lora::load_peft(&dir.join("adapter"), &spec, &dev).unwrap();
    (model, lora)
}

/// The uncached next-token logits of `ids`: the whole forward, last row.
fn full_logits(model: &Model, lora: Option<&Lora>, ids: &[u32]) -> Vec<f32> {
    let h = model.hidden_states(ids, lora).unwrap();
    let last = ops::slice_rows(&h, ids.len() - 1, ids.len()).unwrap();
    model.logits(&last, DType::F32).unwrap().to_vec().unwrap()
}

fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 37 + salt * 101 + 11) % vocab) as u32)
        .collect()
}

fn assert_logits_close(what: &str, got: &[f32], want: &[f32]) {
    let (md, i) = max_diff(got, want);
    let bound = 1e-4 * max_abs(want);
    assert!(
        md <= bound,
        "{what}: cached logits max|diff| {md:.3e} at {i} > {bound:.3e}"
    );
}

/// Step by step, the cached logits against the whole forward's, feeding the argmax; the
/// sequence grows past every fixture's window (6) and MiniCPM's original context (8).
#[test]
fn cached_logits_equal_uncached_on_every_family() {
    for name in FAMILIES {
        let (model, lora) = load_family(name);
        let vocab = model.spec.vocab;
        let mut ids = prompt(5, vocab, 0);
        let mut dec = Decoder::new(&model, Some(&lora), 1, 4).unwrap();
        let mut logits = dec.extend(&[(0, &ids)]).unwrap().remove(0);
        for step in 0..16 {
            let want = full_logits(&model, Some(&lora), &ids);
            assert_logits_close(&format!("{name} step {step}"), &logits, &want);
            let next = infer::sample::argmax(&want);
            assert_eq!(
                infer::sample::argmax(&logits),
                next,
                "{name} step {step}: greedy token"
            );
            ids.push(next);
            logits = dec.extend(&[(0, &ids[ids.len() - 1..])]).unwrap().remove(0);
        }
        // A chat turn: several tokens appended to the cached sequence at once.
        let turn = prompt(4, vocab, 3);
        ids.extend(&turn);
        let got = dec.extend(&[(0, &turn)]).unwrap().remove(0);
        assert_logits_close(
            &format!("{name} turn"),
            &got,
            &full_logits(&model, Some(&lora), &ids),
        );
        // A re-rendered conversation sharing a prefix: the cache keeps the prefix.
        let mut edited = ids[..9].to_vec();
        edited.extend(prompt(3, vocab, 5));
        let got = dec.set_sequence(0, &edited).unwrap();
        assert_logits_close(
            &format!("{name} shared prefix"),
            &got,
            &full_logits(&model, Some(&lora), &edited),
        );
        assert_eq!(dec.cache.ids(0), edited.as_slice());
    }
}

#[test]
fn cached_greedy_generation_equals_uncached_on_every_family() {
    for name in FAMILIES {
        let (model, lora) = load_family(name);
        let vocab = model.spec.vocab;
        let prompts: Vec<Vec<u32>> = (0..3).map(|b| prompt(3 + 4 * b, vocab, b)).collect();
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| infer::generate_ids_uncached(&model, Some(&lora), p, 20, None).unwrap())
            .collect();
        for (b, p) in prompts.iter().enumerate() {
            let got = infer::generate_ids(&model, Some(&lora), p, 20, None).unwrap();
            assert_eq!(got, want[b], "{name}: prompt {b} alone");
        }
        let opts = GenerateOptions::greedy(20, None);
        let batch = infer::generate(&model, Some(&lora), &prompts, &opts).unwrap();
        for (b, g) in batch.iter().enumerate() {
            assert_eq!(g.tokens, want[b], "{name}: prompt {b} in a batch of 3");
            assert_eq!(g.stop, StopReason::MaxTokens);
        }
        // Without the adapter too.
        let p = &prompts[1];
        assert_eq!(
            infer::generate_ids(&model, None, p, 12, None).unwrap(),
            infer::generate_ids_uncached(&model, None, p, 12, None).unwrap(),
            "{name}: base model"
        );
    }
}

/// A stop token ends a sequence (and is not returned) while the others of the batch go on; the
/// token limit ends the rest.
#[test]
fn stop_tokens_and_limits_per_sequence() {
    let (model, lora) = load_family("qwen2");
    let vocab = model.spec.vocab;
    let prompts: Vec<Vec<u32>> = (0..2).map(|b| prompt(6, vocab, b)).collect();
    let free = infer::generate(
        &model,
        Some(&lora),
        &prompts,
        &GenerateOptions::greedy(10, None),
    )
    .unwrap();
    // Sequence 0's fourth token as its stop token, where sequence 1 does not emit it first.
    let stop = free[0].tokens[3];
    let opts = GenerateOptions::greedy(10, Some(stop));
    let got = infer::generate(&model, Some(&lora), &prompts, &opts).unwrap();
    let cut = free[0].tokens.iter().position(|&t| t == stop).unwrap();
    assert_eq!(got[0].tokens, free[0].tokens[..cut]);
    assert_eq!(got[0].stop, StopReason::StopToken(stop));
    let cut1 = free[1].tokens.iter().position(|&t| t == stop).unwrap_or(10);
    assert_eq!(got[1].tokens, free[1].tokens[..cut1]);
    let none = infer::generate(
        &model,
        Some(&lora),
        &prompts,
        &GenerateOptions::greedy(0, None),
    )
    .unwrap();
    assert!(none.iter().all(|g| g.tokens.is_empty()));
}

/// The same seed draws the same tokens; a sequence's draws do not depend on its batch; another
/// seed draws others.
#[test]
fn sampled_generation_is_reproducible_from_its_seed() {
    let (model, lora) = load_family("llama");
    let vocab = model.spec.vocab;
    let prompts: Vec<Vec<u32>> = (0..2).map(|b| prompt(5, vocab, b)).collect();
    let opts = |seed: u64| GenerateOptions {
        max_new_tokens: 24,
        sampling: Sampling {
            temperature: 1.5,
            top_k: 50,
            top_p: 0.95,
            min_p: 0.01,
            repetition_penalty: 1.1,
            seed,
        },
        stop_tokens: vec![],
        stop_strings: vec![],
    };
    let a = infer::generate(&model, Some(&lora), &prompts, &opts(7)).unwrap();
    let b = infer::generate(&model, Some(&lora), &prompts, &opts(7)).unwrap();
    assert_eq!(a, b);
    let alone = infer::generate(&model, Some(&lora), &prompts[..1], &opts(7)).unwrap();
    assert_eq!(alone[0].tokens, a[0].tokens);
    let c = infer::generate(&model, Some(&lora), &prompts, &opts(8)).unwrap();
    assert_ne!(a[0].tokens, c[0].tokens);
    let greedy = infer::generate_ids(&model, Some(&lora), &prompts[0], 24, None).unwrap();
    assert_ne!(
        a[0].tokens, greedy,
        "temperature 1.5 should leave the greedy path"
    );
}

#[test]
fn top_k_top_p_min_p_keep_the_right_tokens() {
    let base = Sampling {
        temperature: 1.0,
        ..Default::default()
    };
    let ids = |c: &[(u32, f64)]| c.iter().map(|x| x.0).collect::<Vec<_>>();
    // top-k: the k largest logits, ties at the k-th kept (transformers' rule).
    let z = [1.0f32, 5.0, 3.0, 5.0, 2.0];
    let k = |k| {
        candidates(
            &z,
            &Sampling {
                top_k: k,
                ..base.clone()
            },
        )
    };
    assert_eq!(ids(&k(1)), [1, 3]);
    assert_eq!(ids(&k(2)), [1, 3]);
    assert_eq!(ids(&k(3)), [1, 3, 2]);
    assert_eq!(ids(&k(0)).len(), 5);
    // Probabilities 0.5, 0.3, 0.15, 0.05.
    let z: Vec<f32> = [0.5f64, 0.3, 0.15, 0.05]
        .iter()
        .map(|p| p.ln() as f32)
        .collect();
    let all = candidates(&z, &base);
    for (got, want) in all.iter().map(|x| x.1).zip([0.5, 0.3, 0.15, 0.05]) {
        assert!((got - want).abs() < 1e-6, "softmax {got} vs {want}");
    }
    let p = |p| {
        candidates(
            &z,
            &Sampling {
                top_p: p,
                ..base.clone()
            },
        )
    };
    assert_eq!(ids(&p(0.7)), [0, 1]);
    assert!(
        (p(0.7)[0].1 - 0.625).abs() < 1e-6,
        "renormalised after top-p"
    );
    assert_eq!(ids(&p(0.85)), [0, 1, 2]);
    assert_eq!(ids(&p(0.4)), [0]);
    let m = |m| {
        candidates(
            &z,
            &Sampling {
                min_p: m,
                ..base.clone()
            },
        )
    };
    assert_eq!(ids(&m(0.2)), [0, 1, 2]);
    assert_eq!(ids(&m(0.5)), [0, 1]);
    assert_eq!(ids(&m(1.0)), [0]);
    // Temperature 2: probabilities ∝ sqrt(p).
    let t = candidates(
        &z,
        &Sampling {
            temperature: 2.0,
            ..base.clone()
        },
    );
    let s: f64 = [0.5f64, 0.3, 0.15, 0.05].iter().map(|p| p.sqrt()).sum();
    assert!((t[0].1 - 0.5f64.sqrt() / s).abs() < 1e-6);
    // The filters in transformers' order: top-k 3, then top-p 0.75 of the renormalised three
    // (0.526, 0.316, 0.158: the first two reach 0.842).
    let both = candidates(
        &z,
        &Sampling {
            top_k: 3,
            top_p: 0.75,
            ..base.clone()
        },
    );
    assert_eq!(ids(&both), [0, 1]);
    // Repetition penalty: positive logits divided, negative multiplied, each token once.
    let mut z = [2.0f32, -2.0, 1.0];
    apply_repetition_penalty(&mut z, &[0, 1, 0], 2.0);
    assert_eq!(z, [1.0, -4.0, 1.0]);
}

/// Draws follow the candidates' probabilities (10 000 draws within 0.02 each) and repeat with
/// the seed.
#[test]
fn sampler_draws_follow_the_probabilities() {
    let z: Vec<f32> = [0.5f64, 0.3, 0.15, 0.05]
        .iter()
        .map(|p| p.ln() as f32)
        .collect();
    let cfg = Sampling {
        temperature: 1.0,
        seed: 3,
        ..Default::default()
    };
    let draw = |cfg: &Sampling| -> Vec<u32> {
        let mut s = Sampler::new(cfg, 1).unwrap();
        (0..10_000)
            .map(|_| s.next(0, &mut z.clone(), &[]).unwrap())
            .collect()
    };
    let a = draw(&cfg);
    assert_eq!(a, draw(&cfg));
    for (id, p) in [0.5, 0.3, 0.15, 0.05].iter().enumerate() {
        let f = a.iter().filter(|&&t| t == id as u32).count() as f64 / a.len() as f64;
        assert!((f - p).abs() < 0.02, "token {id}: frequency {f} vs {p}");
    }
    assert_ne!(a, draw(&Sampling { seed: 4, ..cfg }));
    let bad = Sampling {
        top_p: 0.0,
        ..Default::default()
    };
    let e = Sampler::new(&bad, 1).err().unwrap().to_string();
    assert!(e.contains("top_p"), "{e}");
}

/// `decode_attention` over cache rows equals the full attention's rows (causal, a window, a
/// softcap, GQA), bit for bit on the CPU.
#[test]
fn decode_attention_equals_full_attention_rows() {
    let (t, nh, nkv, hd) = (23, 4, 2, 16);
    let q = rand_vec(t * nh * hd, 1);
    let k = rand_vec(t * nkv * hd, 2);
    let v = rand_vec(t * nkv * hd, 3);
    let (q, k, v) = (
        Tensor::cpu(q, &[t, nh * hd]).unwrap(),
        Tensor::cpu(k, &[t, nkv * hd]).unwrap(),
        Tensor::cpu(v, &[t, nkv * hd]).unwrap(),
    );
    for (window, softcap) in [(None, None), (Some(5u32), None), (Some(7), Some(0.5f32))] {
        let s = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 0.25,
            softcap,
        };
        let mask = AttnMask::causal(t).with_window(window);
        let (full, _) = ops::attention(&q, &k, &v, &mask, s).unwrap();
        let ranges: Vec<[u32; 2]> = (0..t as u32)
            .map(|p| [window.map_or(0, |w| (p + 1).saturating_sub(w)), p + 1])
            .collect();
        let got = ops::decode_attention(&q, &k, &v, &ranges, s).unwrap();
        assert_eq!(
            got.to_vec().unwrap(),
            full.to_vec().unwrap(),
            "window {window:?} softcap {softcap:?}"
        );
    }
    // An empty range gives zeros; a range past the keys is an error.
    let s = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 0.25,
        softcap: None,
    };
    let q1 = ops::slice_rows(&q, 0, 1).unwrap();
    let z = ops::decode_attention(&q1, &k, &v, &[[4, 4]], s).unwrap();
    assert!(z.to_vec().unwrap().iter().all(|&x| x == 0.0));
    let e = ops::decode_attention(&q1, &k, &v, &[[0, 24]], s)
        .err()
        .unwrap();
    assert!(e.to_string().contains("not within the 23 key rows"), "{e}");
}

/// A word-level tokenizer with `<s>` (bos, id 1) and ChatML tokens.
fn word_tokenizer() -> TextTokenizer {
    use std::str::FromStr;
    let words = [
        "[UNK]",
        "<s>",
        "</s>",
        "<|im_start|>",
        "<|im_end|>",
        "system",
        "user",
        "assistant",
        "What",
        "is",
        "2",
        "+",
        "?",
        "Be",
        "brief",
        ".",
    ];
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = words[..5]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let inner = tokenizers::Tokenizer::from_str(&json.to_string()).unwrap();
    TextTokenizer::new(inner, Some(1), Some(2), true).unwrap()
}

/// The chat path's ids are the template's rendering tokenised: with a template that writes bos
/// (Llama, Gemma) exactly that, one bos; with one that does not, the tokenizer's bos in front
/// once; the system message rendered where the template puts it.
#[test]
fn chat_prompt_ids_are_the_templates_rendering_with_one_bos() {
    let tok = word_tokenizer();
    let msgs = [
        Message::system("Be brief ."),
        Message::user("What is 2 + 2 ?"),
    ];
    let with_bos = ChatTemplate::new(
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}",
        "<s>",
        "</s>",
    )
    .unwrap();
    let rendered = with_bos.render(&msgs, true).unwrap();
    let ids = infer::chat_prompt_ids(&tok, Some(&with_bos), &msgs).unwrap();
    assert_eq!(ids, tok.encode(&rendered).unwrap());
    assert_eq!(
        ids,
        [1, 3, 5, 13, 14, 15, 4, 3, 6, 8, 9, 10, 11, 10, 12, 4, 3, 7]
    );
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1, "one bos");
    let no_bos = ChatTemplate::new(
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}",
        "<s>",
        "</s>",
    )
    .unwrap();
    let ids2 = infer::chat_prompt_ids(&tok, Some(&no_bos), &msgs).unwrap();
    assert_eq!(ids2, ids, "the tokenizer's bos, once");
    // The chat call decodes from exactly these ids: a reply equals generating from them.
    let (model, lora) = load_family("llama");
    let user = [Message::user("What is 2 + 2 ?")];
    let ids = infer::chat_prompt_ids(&tok, Some(&with_bos), &user).unwrap();
    let want = infer::generate_ids_uncached(&model, Some(&lora), &ids, 6, Some(2)).unwrap();
    let got = infer::generate_ids(&model, Some(&lora), &ids, 6, Some(2)).unwrap();
    assert_eq!(got, want);
}

/// Stop strings end the text before them; text streams in deltas that add up to it.
#[test]
fn stop_strings_and_streamed_text() {
    use lorafit::infer::text::TextState;
    let tok = word_tokenizer();
    // "What is 2 + 2 ?" word by word (the word-level decoder joins with spaces).
    let tokens = [8u32, 9, 10, 11, 10, 12];
    let stops = vec!["+ 2".to_string()];
    let mut st = TextState::default();
    let mut shown = String::new();
    let mut hit_at = None;
    for n in 1..=tokens.len() {
        let (d, hit) = st.update(&tok, &tokens[..n], &stops, false).unwrap();
        shown.push_str(&d);
        if hit {
            hit_at = Some(n);
            break;
        }
    }
    assert_eq!(hit_at, Some(5));
    let (text, stop) = st.stopped_at.clone().unwrap();
    assert_eq!(stop, "+ 2");
    assert_eq!(shown, text);
    assert_eq!(text.trim_end(), "What is 2");
    // Without stops the deltas add up to the whole text.
    let mut st = TextState::default();
    let mut shown = String::new();
    for n in 1..=tokens.len() {
        shown.push_str(
            &st.update(&tok, &tokens[..n], &[], n == tokens.len())
                .unwrap()
                .0,
        );
    }
    assert_eq!(shown, tok.decode(&tokens).unwrap());
}

/// SmolLM2 (Q4_1 GGUF): cached greedy generation from its chat template equals the uncached one
/// token for token; the chat path's ids are the template's rendering.
#[test]
fn smollm2_cached_generation_equals_uncached() {
    let Some(path) = smollm2_or_skip("smollm2_cached_generation_equals_uncached") else {
        return;
    };
    let loaded = lorafit::train::trainer::load_model_and_tokenizer(
        path.to_str().unwrap(),
        &Device::Cpu,
        lorafit::model::BaseQuant::None,
    )
    .unwrap();
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let template = loaded
        .template
        .as_ref()
        .expect("SmolLM2 has a chat template");
    let msgs = [Message::user("What is the capital of France?")];
    let ids = infer::chat_prompt_ids(tok, Some(template), &msgs).unwrap();
    let rendered = template.render(&msgs, true).unwrap();
    let mut want_ids = tok.encode(&rendered).unwrap();
    if tok.add_bos() && want_ids.first() != tok.bos_id().as_ref() {
        want_ids.insert(0, tok.bos_id().unwrap());
    }
    assert_eq!(ids, want_ids);
    let eos = tok.eos_id();
    let want = infer::generate_ids_uncached(model, None, &ids, 24, eos).unwrap();
    let got = infer::generate_ids(model, None, &ids, 24, eos).unwrap();
    assert_eq!(
        got,
        want,
        "{:?} vs {:?}",
        tok.decode(&got),
        tok.decode(&want)
    );
    assert!(!got.is_empty());
}

/// `lorafit generate --chat-template FILE` renders the prompt with that template in place of the
/// model's (here the model has none): a template that puts three words before the messages makes
/// a prompt three tokens longer than the plain text the model alone gets.
#[test]
fn generate_renders_with_the_chat_template_flag() {
    let dir = std::env::temp_dir().join(format!("lorafit-gen-template-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    let template = dir.join("prefixed.jinja");
    std::fs::write(
        &template,
        "w7 w7 w7 {% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    .unwrap();
    let prefill = |extra: &[&std::ffi::OsStr]| -> usize {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["generate", "--max-new-tokens", "2", "--model"])
            .arg(&model)
            .args(extra)
            .arg("w5 w6")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        let after = err
            .split("prefill ")
            .nth(1)
            .unwrap_or_else(|| panic!("{err}"));
        after.split(' ').next().unwrap().parse().unwrap()
    };
    let plain = prefill(&[]);
    let templated = prefill(&["--chat-template".as_ref(), template.as_os_str()]);
    assert_eq!(templated, plain + 3);
}

/// Generation keeps to the model's context (the llama fixture's 64 positions): a reply stops when
/// it and the prompt fill it, with the cached and the uncached path alike; a prompt that fills it
/// gets no token; a longer one is refused with both numbers.
#[test]
fn generation_keeps_to_the_models_context() {
    let (model, lora) = load_family("llama");
    let vocab = model.spec.vocab;
    assert_eq!(infer::context_length(&model), 64);
    let near_full = prompt(60, vocab, 1);
    let opts = GenerateOptions::greedy(20, None);
    let got =
        infer::generate(&model, Some(&lora), std::slice::from_ref(&near_full), &opts).unwrap();
    assert_eq!(got[0].tokens.len(), 4);
    assert_eq!(got[0].stop, StopReason::Context);
    let uncached = infer::generate_ids_uncached(&model, Some(&lora), &near_full, 20, None).unwrap();
    assert_eq!(got[0].tokens, uncached);
    // Exactly the room: the token limit is what stops it.
    let exact = infer::generate(
        &model,
        Some(&lora),
        &[near_full],
        &GenerateOptions::greedy(4, None),
    )
    .unwrap();
    assert_eq!(exact[0].stop, StopReason::MaxTokens);
    assert_eq!(exact[0].tokens, uncached);

    let full = prompt(64, vocab, 2);
    let got = infer::generate(&model, Some(&lora), &[full], &opts).unwrap();
    assert!(got[0].tokens.is_empty());
    assert_eq!(got[0].stop, StopReason::Context);

    let long = prompt(65, vocab, 3);
    let e = infer::generate(&model, Some(&lora), std::slice::from_ref(&long), &opts).unwrap_err();
    assert_eq!(
        e.downcast_ref::<infer::PromptTooLong>(),
        Some(&infer::PromptTooLong {
            tokens: 65,
            context: 64
        })
    );
    let message = e.to_string();
    assert!(
        message.contains("65") && message.contains("64"),
        "{message}"
    );
    assert!(infer::generate_ids_uncached(&model, None, &long, 4, None).is_err());
    // In a batch the refused prompt is named.
    let e = infer::generate(&model, None, &[prompt(3, vocab, 0), long], &opts).unwrap_err();
    assert!(
        format!("{e:#}").starts_with("generate: prompt 1: "),
        "{e:#}"
    );
}

/// `lorafit generate` at the context: a prompt that fills it says so on stderr (no token is
/// generated), and `--check-uncached` checks the steps the context leaves, saying so.
#[test]
fn generate_says_where_the_context_stopped_it() {
    let dir = std::env::temp_dir().join(format!("lorafit-gen-context-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    let words = |n: usize| {
        (0..n)
            .map(|i| format!("w{}", 2 + i % 200))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let generate = |extra: &[&str], prompt: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["generate", "--model"])
            .arg(&model)
            .args(extra)
            .arg(prompt)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        err
    };
    let err = generate(&["--max-new-tokens", "8"], &words(64));
    assert!(
        err.contains(
            "stopped at the model's context: the prompt's 64 tokens and the reply's 0 fill its 64"
        ),
        "{err}"
    );
    let err = generate(&["--check-uncached", "--max-new-tokens", "5"], &words(62));
    assert!(err.contains("checking 2 steps, not 5"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lorafit generate -` reads the prompt from standard input, as Unix tools do: the same reply
/// and prompt length as the prompt given as the argument (the line break `echo` adds dropped);
/// `--raw` with an empty standard input is refused, saying so.
#[test]
fn generate_reads_a_prompt_of_dash_from_standard_input() {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("lorafit-gen-stdin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    let generate = |extra: &[&str], prompt: &str, stdin: &[u8]| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["generate", "--max-new-tokens", "4", "--model"])
            .arg(&model)
            .args(extra)
            .arg(prompt)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A command that does not read its input may end first: a closed pipe is no failure.
        let _ = child.stdin.take().unwrap().write_all(stdin);
        child.wait_with_output().unwrap()
    };
    let prefill = |err: &str| -> String {
        let after = err
            .split("prefill ")
            .nth(1)
            .unwrap_or_else(|| panic!("{err}"));
        after.split(' ').next().unwrap().to_string()
    };
    for extra in [&[][..], &["--raw"][..]] {
        let given = generate(extra, "w5 w6 w7", b"");
        let piped = generate(extra, "-", b"w5 w6 w7\n");
        let (given_err, piped_err) = (
            String::from_utf8_lossy(&given.stderr),
            String::from_utf8_lossy(&piped.stderr),
        );
        assert!(given.status.success(), "{given_err}");
        assert!(piped.status.success(), "{piped_err}");
        assert_eq!(prefill(&piped_err), prefill(&given_err), "{extra:?}");
        assert_eq!(piped.stdout, given.stdout, "{extra:?}");
    }
    let out = generate(&["--raw"], "-", b"\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--raw -: standard input is empty"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lorafit generate` (or `chat`) on `model` with `args` and the prompt, standard input given:
/// its exit status, standard output and standard error.
fn run_lorafit(
    command: &str,
    model: &std::path::Path,
    args: &[&str],
    stdin: &str,
) -> (bool, String, String) {
    use std::io::Write;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args([command, "--max-new-tokens", "3", "--model"])
        .arg(model)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A temporary folder holding the tiny model (`tests/common/tiny_run.rs`).
fn tiny_model(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("lorafit-gen-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    (dir, model)
}

/// A model's own template that never shows the messages (a constant text, `messages` misspelt)
/// is refused by `generate` and `chat` as `train` refuses it from a file, naming the file and
/// `--chat-template`, rather than answering a prompt the model was never given.
#[test]
fn generate_and_chat_refuse_a_template_that_never_shows_the_messages() {
    let (dir, model) = tiny_model("hides");
    for template in [
        "w5 w6",
        "{% for m in mesages %}{{ m['content'] }} {% endfor %}",
    ] {
        let config = serde_json::json!({"eos_token": "w1", "chat_template": template});
        std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
        for (command, prompt) in [("generate", "w9 w10"), ("chat", "")] {
            let args: &[&str] = if prompt.is_empty() { &[] } else { &[prompt] };
            let (ok, _, err) = run_lorafit(command, &model, args, "w9 w10\n");
            assert!(!ok, "{command} with {template:?}: {err}");
            assert!(
                err.contains("tokenizer_config.json")
                    && err.contains("never shows the messages")
                    && err.contains("--chat-template"),
                "{command} with {template:?}: {err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `generation_config.json`'s `eos_token_id` (an id or a list) ends a reply as in transformers'
/// `generate`; one that cannot be read is a warning naming it, and generation runs.
#[test]
fn generate_stops_on_the_generation_configs_eos_token_id() {
    let (dir, model) = tiny_model("genconfig");
    let (ok, out, err) = run_lorafit("generate", &model, &["w9 w10"], "");
    assert!(ok, "{err}");
    let first: u32 = out.split_whitespace().next().unwrap()[1..].parse().unwrap();
    let config = model.join("generation_config.json");
    for eos in [serde_json::json!([1, first]), serde_json::json!(first)] {
        std::fs::write(
            &config,
            serde_json::json!({"eos_token_id": eos}).to_string(),
        )
        .unwrap();
        let (ok, out, err) = run_lorafit("generate", &model, &["w9 w10"], "");
        assert!(
            ok && out.trim().is_empty(),
            "eos_token_id {eos}: {out:?} {err}"
        );
    }
    let loaded = lorafit::train::trainer::load_model_and_tokenizer(
        model.to_str().unwrap(),
        &Device::Cpu,
        lorafit::model::BaseQuant::None,
    )
    .unwrap();
    let stops = infer::default_stop_tokens(&loaded.tokenizer, None, &loaded.model);
    assert!(stops.contains(&first) && stops.contains(&1), "{stops:?}");
    // eval's replies (`infer::chat`) end there too: before, only the tokenizer's eos did.
    let (tok, template) = (&loaded.tokenizer, loaded.template.as_ref());
    let reply = infer::chat(&loaded.model, None, tok, template, "w9 w10", 8).unwrap();
    assert_eq!(reply, "", "eval's reply past generation_config's eos");
    std::fs::remove_file(&config).unwrap();
    let loaded = lorafit::train::trainer::load_model_and_tokenizer(
        model.to_str().unwrap(),
        &Device::Cpu,
        lorafit::model::BaseQuant::None,
    )
    .unwrap();
    let (tok, template) = (&loaded.tokenizer, loaded.template.as_ref());
    let reply = infer::chat(&loaded.model, None, tok, template, "w9 w10", 8).unwrap();
    assert!(
        !reply.is_empty(),
        "without generation_config.json the reply runs on"
    );
    for broken in ["{\"eos_token_id\": [1,", "{\"eos_token_id\": \"w4\"}"] {
        std::fs::write(&config, broken).unwrap();
        let (ok, got, err) = run_lorafit("generate", &model, &["w9 w10"], "");
        assert!(ok, "{err}");
        assert_eq!(got, out);
        assert!(
            err.contains("warning: ") && err.contains("generation_config.json"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A folder with a SentencePiece `tokenizer.model` and no `tokenizer.json` says that lorafit
/// reads tokenizer.json and how transformers writes it.
#[test]
fn a_folder_with_only_tokenizer_model_says_how_to_write_tokenizer_json() {
    let (dir, model) = tiny_model("spm");
    std::fs::rename(model.join("tokenizer.json"), model.join("tokenizer.model")).unwrap();
    let (ok, _, err) = run_lorafit("generate", &model, &["w9"], "");
    assert!(!ok);
    assert!(
        err.contains("tokenizer.model")
            && err.contains("no tokenizer.json")
            && err.contains("save_pretrained"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The minicpm GGUF fixture with `template` as its `tokenizer.chat_template`.
fn gguf_with_template(path: &std::path::Path, template: &str) {
    use lorafit::export::gguf_writer::{GgufTensor, GgufWriter};
    let g = lorafit::model::gguf::GgufFile::open(&fixture("gguf/minicpm.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.set(k, v.clone());
    }
    w.set_str("tokenizer.chat_template", template);
    for info in g.tensor_infos() {
        w.add_tensor(GgufTensor {
            name: info.name.clone(),
            dims: info.shape.clone(),
            ggml_type: info.ggml_type,
            data: g.tensor_bytes(&info.name).unwrap().to_vec(),
        })
        .unwrap();
    }
    w.write(path).unwrap();
}

/// A template that does not compile is named where it is: the folder's `chat_template.jinja`
/// (not the tokenizer_config.json beside it), a GGUF's `tokenizer.chat_template`, each with
/// `--chat-template`, which then renders in its place.
#[test]
fn template_errors_name_the_file_the_template_came_from() {
    let (dir, model) = tiny_model("origin");
    std::fs::write(model.join("chat_template.jinja"), "{% for %}").unwrap();
    let good = dir.join("good.jinja");
    std::fs::write(
        &good,
        "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    .unwrap();
    let (ok, _, err) = run_lorafit("generate", &model, &["w9"], "");
    assert!(!ok);
    let jinja = model.join("chat_template.jinja").display().to_string();
    let config = model.join("tokenizer_config.json").display().to_string();
    assert!(
        err.contains(&format!("chat template from {jinja}"))
            && !err.contains(&config)
            && err.contains("does not compile")
            && err.contains("--chat-template"),
        "{err}"
    );
    let good_arg = good.to_str().unwrap();
    let (ok, _, err) = run_lorafit("generate", &model, &["--chat-template", good_arg, "w9"], "");
    assert!(ok, "{err}");

    let gguf = dir.join("templated.gguf");
    gguf_with_template(&gguf, "{% if %}");
    let (ok, _, err) = run_lorafit("generate", &gguf, &["hello"], "");
    assert!(!ok);
    assert!(
        err.contains(&gguf.display().to_string())
            && err.contains("tokenizer.chat_template")
            && err.contains("does not compile")
            && err.contains("--chat-template"),
        "{err}"
    );
    let (ok, _, err) = run_lorafit(
        "generate",
        &gguf,
        &["--chat-template", good_arg, "hello"],
        "",
    );
    assert!(ok, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tokenizer.json whose model type the tokenizers library does not read names that type, not
/// serde's untagged enum; a template that renders nothing for the conversation says so, not
/// that prompt 0 has no tokens.
#[test]
fn tokenizer_and_template_errors_say_what_is_wrong() {
    let (dir, model) = tiny_model("opaque");
    let text = std::fs::read_to_string(model.join("tokenizer.json")).unwrap();
    let original = text.clone();
    let text = text.replace("\"WordLevel\"", "\"WordLevelV2\"");
    std::fs::write(model.join("tokenizer.json"), text).unwrap();
    let (ok, _, err) = run_lorafit("generate", &model, &["w9"], "");
    assert!(!ok);
    assert!(
        err.contains("\"WordLevelV2\"")
            && err.contains("not one the tokenizers library reads")
            && !err.contains("untagged enum"),
        "{err}"
    );
    std::fs::write(model.join("tokenizer.json"), original).unwrap();

    // The messages are shown only after a system message: a user message alone renders nothing.
    let template = "{% if messages[0]['role'] == 'system' %}{% for m in messages %}{{ m['content'] }} {% endfor %}{% endif %}";
    let config = serde_json::json!({"eos_token": "w1", "chat_template": template});
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    let (ok, _, err) = run_lorafit("generate", &model, &["w9"], "");
    assert!(!ok);
    assert!(
        err.contains("rendered nothing for this conversation")
            && err.contains("tokenizer_config.json")
            && !err.contains("has no tokens"),
        "{err}"
    );
    let (ok, _, err) = run_lorafit("generate", &model, &["--system", "w3", "w9"], "");
    assert!(ok, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
