//! Bad model input gives an error that names the file and the tensor, never a panic: a missing
//! folder, an unknown architecture, a shape that disagrees with config.json, a truncated
//! safetensors file, a missing tensor.

mod common;
use lorafit::tensor::Device;
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lorafit-bad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_fixture(to: &Path) {
    let src = common::fixture("models/llama");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), to.join(f)).unwrap();
    }
}

fn load_err(path: &Path) -> String {
    match lorafit::model::load(path, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn missing_path_is_named() {
    let e = load_err(Path::new("/nonexistent/model"));
    assert!(e.contains("/nonexistent/model"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let d = scratch("arch");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("LlamaForCausalLM", "GPTNeoXForCausalLM")
        .replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("GPTNeoXForCausalLM") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn shape_disagreeing_with_config_names_file_and_tensor() {
    let d = scratch("shape");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 96", "\"intermediate_size\": 128");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("mlp.gate_proj.weight")
            && e.contains(d.to_str().unwrap())
            && e.contains("[96, 64]"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_names_the_file() {
    let d = scratch("trunc");
    copy_fixture(&d);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model.safetensors") && (e.contains("truncated") || e.contains("past the end")),
        "{e}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let d = scratch("missing");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model.layers.2.") && e.contains("missing"),
        "{e}"
    );
}
