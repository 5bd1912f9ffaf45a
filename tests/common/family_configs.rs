//! Tiny configs of each family, shared by the tests that run every family (`mode_matrix`,
//! `packing`), and the random model and adapter they run.

use lorafit::model::weights::{load_weights, RandomSource};
use lorafit::model::{Lora, LoraConfig, Model, ModelSpec};
use lorafit::tensor::Device;

/// A CPU model of `config` with random weights (`weight_seed`) and a rank-4 adapter whose B
/// matrices are random too (`lora_seed`, scale 0.1), so that every LoRA gradient is non-zero.
pub fn random_model_and_lora(config: &str, weight_seed: u64, lora_seed: u64) -> (Model, Lora) {
    let spec = ModelSpec::from_config_json(config).unwrap();
    let dev = Device::Cpu;
    let source = RandomSource {
        spec: spec.clone(),
        seed: weight_seed,
    };
    let model = Model::new(
        spec.clone(),
        load_weights(&spec, &source, &dev).unwrap(),
        dev.clone(),
    );
    let config = LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..Default::default()
    };
    let mut lora = Lora::new(&spec, config, &dev).unwrap();
    let mut rng = lorafit::tensor::Rng(lora_seed);
    for (_, _, p) in lora.pairs_mut() {
        for x in p.b.as_cpu_mut().unwrap() {
            *x = (rng.normal() * 0.1) as f32;
        }
    }
    lora.refresh_compute_copies().unwrap();
    (model, lora)
}

pub const QWEN2: &str = r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":200,"tie_word_embeddings":true}"#;
pub const GEMMA2: &str = r#"{"architectures":["Gemma2ForCausalLM"],"hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":200,"query_pre_attn_scalar":24,"attn_logit_softcapping":0.05,"final_logit_softcapping":0.1,"sliding_window":6,"tie_word_embeddings":true}"#;
pub const GEMMA3: &str = r#"{"architectures":["Gemma3ForCausalLM"],"hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":200,"query_pre_attn_scalar":16,"sliding_window":6,"layer_types":["sliding_attention","full_attention","sliding_attention"],"rope_theta":1000000.0,"rope_local_base_freq":10000.0,"rope_scaling":{"rope_type":"linear","factor":8.0},"tie_word_embeddings":true}"#;
pub const MINICPM: &str = r#"{"architectures":["MiniCPMForCausalLM"],"hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":200,"scale_emb":12,"scale_depth":1.4,"dim_model_base":16,"max_position_embeddings":64,"rope_scaling":{"rope_type":"longrope","short_factor":[1.0,1.2,1.5,2.0,2.5,3.0,3.5,4.0],"long_factor":[1.1,1.4,1.9,2.3,2.9,3.3,3.9,4.4],"original_max_position_embeddings":16},"tie_word_embeddings":false}"#;

/// Gemma 4: [sliding, full, sliding, sliding, full], layers 3 and 4 sharing the k/v of 2 and 1
/// (segment sizes 1 and 2 split donors from sharers, 2 also keeps 2 with 3), per-layer inputs,
/// a double-wide MLP on the sharers, proportional RoPE on 32-wide global heads.
pub const GEMMA4: &str = r#"{"architectures":["Gemma4ForCausalLM"],"model_type":"gemma4_text","hidden_size":64,"intermediate_size":48,"num_hidden_layers":5,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"global_head_dim":32,"vocab_size":200,"sliding_window":6,"layer_types":["sliding_attention","full_attention","sliding_attention","sliding_attention","full_attention"],"num_kv_shared_layers":2,"hidden_size_per_layer_input":8,"vocab_size_per_layer_input":200,"use_double_wide_mlp":true,"final_logit_softcapping":0.1,"tie_word_embeddings":true}"#;
