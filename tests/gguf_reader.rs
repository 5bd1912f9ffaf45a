//! Tests for the GGUF reader and dequantizers: bit-exact comparison against
//! gguf-py references (tests/fixtures/gguf/quant_ref.gguf, made by
//! scripts/make_gguf_fixtures.py), bad-input handling, and — where the
//! SmolLM2-135M-Instruct.Q4_1 GGUF is cached or LORAFIT_SMOLLM2_GGUF points at
//! it — checks on the real model.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lorafit::model::gguf::{dequantize, GgmlType, GgufFile, MetaValue};

const SUPPORTED: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    std::env::temp_dir().join(format!(
        "lorafit-gguf-test-{}-{n}-{tag}.gguf",
        std::process::id()
    ))
}

fn write_temp(tag: &str, bytes: &[u8]) -> PathBuf {
    let p = temp_path(tag);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every supported type must dequantize BIT-EXACTLY like gguf-py (whose
/// numpy code performs the same f32 operations in the same order as ggml's
/// `dequantize_row_*`, without fused multiply-add). No ulp tolerance needed.
#[test]
fn dequantize_matches_gguf_py_exactly() {
    let f = GgufFile::open(&fixture("quant_ref.gguf")).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.version(), 3);
    for ty in SUPPORTED {
        let q = f.tensor_info(&format!("q.{ty}")).unwrap();
        assert_eq!(q.ggml_type, ty);
        assert_eq!(q.shape, vec![512, 2]);
        assert_eq!(q.torch_shape(), vec![2, 512]);
        assert_eq!(q.offset % 64, 0);
        let got = f.tensor_f32(&q.name).unwrap();
        let want = f.tensor_f32(&format!("ref.{ty}")).unwrap();
        assert_eq!(got.len(), 1024);
        assert!(want.iter().all(|x| x.is_finite()));
        let mismatches = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            mismatches, 0,
            "{ty}: {mismatches} values differ from gguf-py"
        );

        // Same via the free function.
        let mut out = vec![0f32; 1024];
        dequantize(ty, f.tensor_bytes(&q.name).unwrap(), 1024, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&want), "{ty}");
    }
}

/// Tiles the fixture bytes so the tensor is large enough for the rayon path.
#[test]
fn parallel_dequantize_matches_serial() {
    let f = GgufFile::open(&fixture("quant_ref.gguf")).unwrap();
    let reps = 200; // 200 * 1024 elements > parallel threshold
    for ty in SUPPORTED {
        let raw = f.tensor_bytes(&format!("q.{ty}")).unwrap();
        let want = f.tensor_f32(&format!("ref.{ty}")).unwrap();
        let big: Vec<u8> = raw.iter().copied().cycle().take(raw.len() * reps).collect();
        let mut out = vec![f32::NAN; 1024 * reps];
        dequantize(ty, &big, 1024 * reps, &mut out).unwrap();
        for (i, chunk) in out.chunks(1024).enumerate() {
            assert_eq!(bits(chunk), bits(&want), "{ty} rep {i}");
        }
    }
}

#[test]
fn metadata_accessors() {
    let f = GgufFile::open(&fixture("quant_ref.gguf")).unwrap();
    assert_eq!(f.arch().unwrap(), "lorafit-test");
    assert_eq!(f.get_u32("test.u8").unwrap(), 200);
    assert_eq!(f.get("test.i8"), Some(&MetaValue::I8(-100)));
    assert_eq!(f.get_u32("test.u16").unwrap(), 60000);
    assert!(f.get_u32("test.i16").is_err()); // negative
    assert_eq!(f.get("test.i16").unwrap().as_i64(), Some(-30000));
    assert_eq!(f.get_u32("test.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get("test.i32").unwrap().as_i32(), Some(-2_000_000_000));
    assert_eq!(f.get_usize("test.u64").unwrap(), 1 << 40);
    assert!(f.get_u32("test.u64").is_err()); // does not fit
    assert_eq!(f.get("test.i64").unwrap().as_i64(), Some(-(1 << 40)));
    assert_eq!(f.get_f32("test.f32").unwrap(), 1.5);
    assert_eq!(f.get_f32("test.f64").unwrap(), 2.25);
    assert!(f.get_bool("test.bool").unwrap());
    assert_eq!(f.get_str("test.str").unwrap(), "héllo");
    assert_eq!(
        f.get_str_array("test.str_array").unwrap(),
        vec!["a", "bc", "<|im_start|>"]
    );
    assert_eq!(f.get_i32_array("test.i32_array").unwrap(), vec![1, -2, 3]);
    assert_eq!(f.get_f32_array("test.f32_array").unwrap(), vec![0.5, -1.25]);
    assert_eq!(f.get_usize("general.alignment").unwrap(), 64);

    let e = f.get_str("test.u32").unwrap_err().to_string();
    assert!(
        e.contains("quant_ref.gguf") && e.contains("test.u32"),
        "{e}"
    );
    let e = f.get_u32("no.such.key").unwrap_err().to_string();
    assert!(
        e.contains("quant_ref.gguf") && e.contains("no.such.key"),
        "{e}"
    );
    let e = f.tensor_bytes("nope").unwrap_err().to_string();
    assert!(e.contains("quant_ref.gguf") && e.contains("nope"), "{e}");
}

#[test]
fn unsupported_type_errors_name_file_tensor_and_type() {
    let f = GgufFile::open(&fixture("quant_ref.gguf")).unwrap();
    let t = f.tensor_info("unsupported.Q5_0").unwrap();
    assert_eq!(t.ggml_type, GgmlType::Q5_0);
    assert_eq!(f.tensor_bytes("unsupported.Q5_0").unwrap().len(), 22);
    let e = format!("{:#}", f.tensor_f32("unsupported.Q5_0").unwrap_err());
    assert!(e.contains("quant_ref.gguf"), "{e}");
    assert!(e.contains("unsupported.Q5_0"), "{e}");
    assert!(e.contains("Q5_0"), "{e}");
}

// ---------- bad input ----------

/// Minimal GGUF writer for hand-made broken files.
struct W(Vec<u8>);
impl W {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut v = b"GGUF".to_vec();
        v.extend(version.to_le_bytes());
        v.extend(n_tensors.to_le_bytes());
        v.extend(n_kv.to_le_bytes());
        W(v)
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.0.extend((s.len() as u64).to_le_bytes());
        self.0.extend(s.as_bytes());
        self
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn kv_str(&mut self, k: &str, v: &str) -> &mut Self {
        self.str(k).u32(8).str(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad_and_data(&mut self, data: &[u8]) -> Vec<u8> {
        while !self.0.len().is_multiple_of(32) {
            self.0.push(0);
        }
        self.0.extend(data);
        self.0.clone()
    }
}

fn open_err(bytes: &[u8], tag: &str) -> (String, PathBuf) {
    let p = write_temp(tag, bytes);
    let r = GgufFile::open(&p);
    let e = match r {
        Ok(_) => panic!("{tag}: expected an error"),
        Err(e) => format!("{e:#}"),
    };
    let _ = std::fs::remove_file(&p);
    (e, p)
}

fn assert_names_file(e: &str, p: &Path) {
    let name = p.file_name().unwrap().to_str().unwrap();
    assert!(e.contains(name), "error does not name the file {name}: {e}");
}

#[test]
fn synthetic_file_ok() {
    let mut w = W::new(2, 1, 1);
    w.kv_str("general.architecture", "x");
    w.tensor("t", &[4], 0, 0);
    let data: Vec<u8> = [1.0f32, 2.0, -3.0, 0.5]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let bytes = w.pad_and_data(&data);
    let p = write_temp("ok", &bytes);
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.tensor_f32("t").unwrap(), vec![1.0, 2.0, -3.0, 0.5]);
    let _ = std::fs::remove_file(&p);
}

#[test]
fn bad_magic_and_version() {
    let mut w = W::new(3, 0, 0);
    let mut bytes = w.pad_and_data(&[]);
    bytes[0] = b'X';
    let (e, p) = open_err(&bytes, "magic");
    assert!(e.contains("magic"), "{e}");
    assert_names_file(&e, &p);

    for v in [1u32, 4, 0x0300_0000] {
        let bytes = W::new(v, 0, 0).pad_and_data(&[]);
        let (e, p) = open_err(&bytes, "version");
        assert!(e.contains("version"), "{e}");
        assert_names_file(&e, &p);
    }
    let (e, p) = open_err(&[], "empty");
    assert_names_file(&e, &p);
}

#[test]
fn unknown_type_id_and_data_past_eof() {
    let mut w = W::new(3, 1, 0);
    w.tensor("blk.0.weird", &[32], 77, 0);
    let (e, p) = open_err(&w.pad_and_data(&[0; 64]), "unknown-type");
    assert_names_file(&e, &p);
    assert!(e.contains("blk.0.weird") && e.contains("77"), "{e}");

    let mut w = W::new(3, 1, 0);
    w.tensor("blk.0.big", &[32, 4], 8, 0); // Q8_0: 4 blocks = 136 bytes
    let (e, p) = open_err(&w.pad_and_data(&[0; 100]), "past-eof");
    assert_names_file(&e, &p);
    assert!(e.contains("blk.0.big") && e.contains("end of file"), "{e}");

    let mut w = W::new(3, 1, 0);
    w.tensor("huge_offset", &[1], 0, u64::MAX - 31);
    let (e, p) = open_err(&w.pad_and_data(&[0; 4]), "huge-offset");
    assert_names_file(&e, &p);
    assert!(e.contains("huge_offset"), "{e}");

    let mut w = W::new(3, 1, 0);
    w.tensor("overflow", &[u64::MAX, 3], 0, 0);
    let (e, p) = open_err(&w.pad_and_data(&[0; 4]), "overflow");
    assert_names_file(&e, &p);
    assert!(e.contains("overflow"), "{e}");

    let mut w = W::new(3, 1, 0);
    w.tensor("partial_block", &[33], 8, 0);
    let (e, _) = open_err(&w.pad_and_data(&[0; 128]), "partial");
    assert!(e.contains("partial_block"), "{e}");

    // Absurd counts must not allocate or panic.
    let bytes = W::new(3, u64::MAX, u64::MAX).pad_and_data(&[]);
    let (e, p) = open_err(&bytes, "counts");
    assert_names_file(&e, &p);
    let mut w = W::new(3, 0, 1);
    w.str("arr").u32(9).u32(8).u64(u64::MAX);
    let (e, p) = open_err(&w.pad_and_data(&[]), "array");
    assert_names_file(&e, &p);
    assert!(e.contains("arr"), "{e}");
}

#[test]
fn truncated_fixture_never_panics() {
    let full = std::fs::read(fixture("quant_ref.gguf")).unwrap();
    let f = GgufFile::open(&fixture("quant_ref.gguf")).unwrap();
    let data_start = f.data_start();
    let mut cuts: Vec<usize> = (0..data_start + 64).step_by(7).collect();
    cuts.extend([data_start - 1, data_start]);
    for cut in cuts {
        let (e, p) = open_err(&full[..cut], "trunc");
        assert_names_file(&e, &p);
    }
    // Cut inside the data: error names the first tensor that no longer fits.
    let last = f.tensor_infos().iter().max_by_key(|t| t.offset).unwrap();
    let end = data_start + last.offset as usize + last.byte_size();
    let (e, p) = open_err(&full[..end - 1], "trunc-data");
    assert!(e.contains(&last.name), "{e}");
    assert_names_file(&e, &p);
    // The trailing alignment padding after the last tensor is optional.
    assert!(GgufFile::open(&write_temp("trunc-pad", &full[..end])).is_ok());
}

#[test]
fn corrupted_header_never_panics() {
    let full = std::fs::read(fixture("quant_ref.gguf")).unwrap();
    let header_len = GgufFile::open(&fixture("quant_ref.gguf"))
        .unwrap()
        .data_start();
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let p = temp_path("corrupt");
    for _ in 0..300 {
        let mut b = full.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() as usize) % header_len;
            b[i] = next() as u8;
        }
        std::fs::write(&p, &b).unwrap();
        if let Ok(f) = GgufFile::open(&p) {
            // Whatever parsed must be readable without panicking.
            for t in f.tensor_infos() {
                let _ = f.tensor_f32(&t.name);
            }
        }
    }
    let _ = std::fs::remove_file(&p);
}

// ---------- real model ----------

#[test]
fn smollm2_metadata_and_dequantization() {
    let Some(path) = common::smollm2_or_skip("smollm2_metadata_and_dequantization") else {
        return;
    };
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.arch().unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_usize("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_usize("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 8192);
    assert_eq!(f.get_u32("llama.vocab_size").unwrap(), 49152);
    assert_eq!(f.get_u32("llama.rope.dimension_count").unwrap(), 64);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        1e-5
    );
    assert_eq!(f.tensor_infos().len(), 272);
    assert!(
        f.tensor_info("output.weight").is_err(),
        "embeddings are tied"
    );
    let emb = f.tensor_info("token_embd.weight").unwrap();
    assert_eq!(emb.shape, vec![576, 49152]);
    assert_eq!(emb.ggml_type, GgmlType::Q8_0);
    let q = f.tensor_info("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (q.shape.clone(), q.ggml_type),
        (vec![576, 576], GgmlType::Q4_1)
    );
    let k = f.tensor_info("blk.0.attn_k.weight").unwrap();
    assert_eq!(
        (k.shape.clone(), k.ggml_type),
        (vec![576, 192], GgmlType::Q4_1)
    );
    let down = f.tensor_info("blk.0.ffn_down.weight").unwrap();
    assert_eq!(down.shape, vec![1536, 576]);
    for t in f.tensor_infos() {
        let want = if t.name == "token_embd.weight" {
            GgmlType::Q8_0
        } else if t.shape.len() == 1 {
            GgmlType::F32
        } else {
            GgmlType::Q4_1
        };
        assert_eq!(t.ggml_type, want, "{}", t.name);
    }

    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2_ref.json")).unwrap())
            .unwrap();
    let mut cache: std::collections::HashMap<String, Vec<f32>> = Default::default();
    let mut n = 0;
    for s in refs["slices"].as_array().unwrap() {
        let name = s["tensor"].as_str().unwrap();
        let data = cache
            .entry(name.to_string())
            .or_insert_with(|| f.tensor_f32(name).unwrap());
        let start = s["start"].as_u64().unwrap() as usize;
        let want: Vec<u32> = s["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            bits(&data[start..start + want.len()]),
            want,
            "{name}@{start}"
        );
        n += want.len();
    }
    assert!(n >= 1000);
    assert!(cache["token_embd.weight"].iter().all(|x| x.is_finite()));
}
