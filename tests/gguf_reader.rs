//! Tests for the GGUF reader and dequantizers: bit-exact comparison against
//! gguf-py references (tests/fixtures/gguf/quant_ref.gguf, made by
//! scripts/make_gguf_fixtures.py), bad-input handling, and — where the
//! SmolLM2-135M-Instruct.Q4_1 GGUF is cached or LORAFIT_SMOLLM2_GGUF points at
//! it — checks on the real model.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lorafit::export::gguf_writer::{GgufTensor, GgufWriter};
use lorafit::model::gguf::{dequantize, GgmlType, GgufFile, MetaValue};
use lorafit::tensor::Device;

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
    let p = write_temp("trunc-pad", &full[..end]);
    assert!(GgufFile::open(&p).is_ok());
    let _ = std::fs::remove_file(&p);
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

/// Files from before GGUF and big-endian GGUFs are named as such.
#[test]
fn old_ggml_and_big_endian_files_are_named() {
    // The old formats' magics, written as little-endian u32s ("ggjt" is stored "tjgg").
    for (stored, name) in [(b"tjgg", "ggjt"), (b"lmgg", "ggml"), (b"fmgg", "ggmf")] {
        let mut bytes = stored.to_vec();
        bytes.extend([3, 0, 0, 0]);
        bytes.extend([0u8; 56]);
        let (e, p) = open_err(&bytes, "ggml");
        assert_names_file(&e, &p);
        assert!(
            e.contains("pre-GGUF GGML file") && e.contains(name) && e.contains("convert"),
            "{e}"
        );
    }
    let bytes = W::new(3u32.swap_bytes(), 0, 0).pad_and_data(&[]);
    let (e, p) = open_err(&bytes, "big-endian");
    assert_names_file(&e, &p);
    assert!(e.contains("big-endian GGUF"), "{e}");
    let mut bytes = W::new(3u32.swap_bytes(), 0, 0).pad_and_data(&[]);
    bytes[..4].copy_from_slice(b"FUGG");
    let (e, _) = open_err(&bytes, "big-endian-magic");
    assert!(e.contains("big-endian GGUF"), "{e}");
}

/// The declared `(type id, dims)` of `layout_file`'s three tensors.
type Declared<'a> = [(u32, &'a [u64]); 3];

/// Three tensors laid out as GGUF writers do (each padded to 32 bytes): `blk.0.attn_norm.weight`
/// (F32 [64], 256 bytes at 0), `blk.0.ffn_down.weight` (Q4_1 [64, 32], 1280 bytes at 256) and
/// `output_norm.weight` (F32 [64], 256 bytes at 1536), each tensor's declared `(type id, dims)`
/// given; `order` is the order of the tensor table.
fn layout_file(declared: Declared, order: [usize; 3]) -> Vec<u8> {
    let names = [
        "blk.0.attn_norm.weight",
        "blk.0.ffn_down.weight",
        "output_norm.weight",
    ];
    let offsets = [0u64, 256, 1536];
    let mut w = W::new(3, 3, 1);
    w.kv_str("general.architecture", "x");
    for i in order {
        w.tensor(names[i], declared[i].1, declared[i].0, offsets[i]);
    }
    let data: Vec<u8> = (0..1792u32).map(|i| (i % 7) as u8).collect();
    w.pad_and_data(&data)
}

/// A tensor whose type or dims were changed after writing (the data no longer spans the bytes
/// up to the next tensor) is refused, naming it, its type and both sizes; tensors out of table
/// order are fine.
#[test]
fn tensor_type_that_does_not_match_its_data_is_refused() {
    const F32: u32 = 0;
    const F16: u32 = 1;
    const Q4_0: u32 = 2;
    const Q4_1: u32 = 3;
    const BF16: u32 = 30;
    let norm: &[u64] = &[64];
    let down: &[u64] = &[64, 32];
    for order in [[0, 1, 2], [2, 0, 1]] {
        let bytes = layout_file([(F32, norm), (Q4_1, down), (F32, norm)], order);
        let p = write_temp("layout-ok", &bytes);
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.tensor_f32("output_norm.weight").unwrap().len(), 64);
        let _ = std::fs::remove_file(&p);
    }
    let cases: [(Declared, &[&str]); 6] = [
        (
            [(F16, norm), (Q4_1, down), (F32, norm)],
            &[
                "'blk.0.attn_norm.weight'",
                "F16",
                "takes 128 bytes",
                "gives it 256 bytes",
            ],
        ),
        (
            [(BF16, norm), (Q4_1, down), (F32, norm)],
            &[
                "'blk.0.attn_norm.weight'",
                "BF16",
                "takes 128 bytes",
                "gives it 256 bytes",
            ],
        ),
        (
            [(F32, norm), (Q4_0, down), (F32, norm)],
            &[
                "'blk.0.ffn_down.weight'",
                "Q4_0",
                "takes 1152 bytes",
                "gives it 1280 bytes",
            ],
        ),
        // The last tensor: its data must end within the alignment of the end of the file.
        (
            [(F32, norm), (Q4_1, down), (F16, norm)],
            &[
                "'output_norm.weight'",
                "F16",
                "takes 128 bytes",
                "gives it 256 bytes",
            ],
        ),
        // Dims that grew: the data would run into the next tensor's.
        (
            [(F32, &[128]), (Q4_1, down), (F32, norm)],
            &[
                "'blk.0.attn_norm.weight'",
                "F32",
                "takes 512 bytes",
                "gives it 256 bytes",
            ],
        ),
        (
            [(F32, norm), (F16, down), (F32, norm)],
            &[
                "'blk.0.ffn_down.weight'",
                "F16",
                "takes 4096 bytes",
                "gives it 1280 bytes",
            ],
        ),
    ];
    for (declared, want) in cases {
        let (e, p) = open_err(&layout_file(declared, [0, 1, 2]), "layout");
        assert_names_file(&e, &p);
        for w in want {
            assert!(e.contains(w), "missing {w:?} in: {e}");
        }
    }
}

/// A GGUF of the Llama fixture (all F32; common::llama_gguf), with `edit` applied to its
/// metadata and tensors before it is written.
fn llama_gguf_with(
    tag: &str,
    edit: impl FnOnce(&mut Vec<(String, MetaValue)>, &mut Vec<GgufTensor>),
) -> PathBuf {
    let base = temp_path(&format!("{tag}-base"));
    common::llama_gguf::write_llama_gguf(&base, |_, _| GgmlType::F32);
    let f = GgufFile::open(&base).unwrap();
    let mut meta = f.metadata().to_vec();
    let mut tensors: Vec<GgufTensor> = f
        .tensor_infos()
        .iter()
        .map(|t| GgufTensor {
            name: t.name.clone(),
            dims: t.shape.clone(),
            ggml_type: t.ggml_type,
            data: f.tensor_bytes(&t.name).unwrap().to_vec(),
        })
        .collect();
    drop(f);
    let _ = std::fs::remove_file(&base);
    edit(&mut meta, &mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.set(&k, v);
    }
    for t in tensors {
        w.add_tensor(t).unwrap();
    }
    let p = temp_path(tag);
    w.write(&p).unwrap();
    p
}

fn set_key(meta: &mut Vec<(String, MetaValue)>, key: &str, v: Option<MetaValue>) {
    meta.retain(|(k, _)| k != key);
    if let Some(v) = v {
        meta.push((key.to_string(), v));
    }
}

/// The error of loading `p` on the CPU (the file is removed).
fn load_err(p: &Path) -> String {
    let r = lorafit::model::load(p, &Device::Cpu);
    let _ = std::fs::remove_file(p);
    match r {
        Ok(_) => panic!("{}: expected an error", p.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn loads(p: &Path) {
    let r = lorafit::model::load(p, &Device::Cpu);
    let _ = std::fs::remove_file(p);
    if let Err(e) = r {
        panic!("{}: {e:#}", p.display());
    }
}

/// `rope.dimension_count` is the number of rotated dims, not the head size: a value other than
/// the head size (partial RoPE, which lorafit does not run) is refused naming the key.
#[test]
fn rope_dimension_count_other_than_the_head_size_is_refused() {
    let u32v = MetaValue::U32;
    for key_length in [None, Some(u32v(16))] {
        let p = llama_gguf_with("rope-dims", |m, _| {
            set_key(m, "llama.attention.key_length", key_length.clone());
            set_key(m, "llama.rope.dimension_count", Some(u32v(8)));
        });
        let e = load_err(&p);
        assert!(
            e.contains("llama.rope.dimension_count is 8") && e.contains("head size is 16"),
            "{e}"
        );
        assert!(!e.contains("config.json"), "{e}");
    }
    loads(&llama_gguf_with("rope-dims-ok", |m, _| {
        set_key(m, "llama.attention.key_length", None);
        set_key(m, "llama.rope.dimension_count", Some(u32v(16)));
    }));
}

/// A tensor whose shape disagrees with the metadata is named by its GGUF name (the Hugging
/// Face name in parentheses), with the keys that imply the expected shape.
#[test]
fn shape_errors_name_the_gguf_tensor_and_the_metadata_keys() {
    let p = llama_gguf_with("ffn-len", |m, _| {
        set_key(m, "llama.feed_forward_length", Some(MetaValue::U32(80)));
    });
    let e = load_err(&p);
    for want in [
        "tensor blk.0.ffn_gate.weight (model.layers.0.mlp.gate_proj.weight) has shape [96, 64]",
        "the GGUF's metadata (llama.feed_forward_length = 80, llama.embedding_length = 64) \
         implies [80, 64]",
    ] {
        assert!(e.contains(want), "missing {want:?} in: {e}");
    }
    assert!(!e.contains("config.json"), "{e}");

    let p = llama_gguf_with("kv-heads", |m, _| {
        set_key(m, "llama.attention.head_count_kv", Some(MetaValue::U32(1)));
    });
    let e = load_err(&p);
    assert!(
        e.contains("tensor blk.0.attn_k.weight (model.layers.0.self_attn.k_proj.weight)")
            && e.contains("llama.attention.head_count_kv = 1")
            && e.contains("llama.attention.key_length = 16"),
        "{e}"
    );
    assert!(!e.contains("config.json"), "{e}");

    // A model-level tensor of the wrong size.
    let p = llama_gguf_with("norm-dims", |_, t| {
        let norm = t
            .iter_mut()
            .find(|t| t.name == "output_norm.weight")
            .unwrap();
        norm.dims = vec![32];
        norm.data.truncate(32 * 4);
    });
    let e = load_err(&p);
    assert!(
        e.contains("tensor output_norm.weight (model.norm.weight) has shape [32]")
            && e.contains("(llama.embedding_length = 64) implies [64]"),
        "{e}"
    );
}

/// A non-finite value is reported under the tensor's GGUF name.
#[test]
fn non_finite_values_name_the_gguf_tensor() {
    for (name, hf) in [
        ("output_norm.weight", "model.norm.weight"),
        (
            "blk.1.ffn_down.weight",
            "model.layers.1.mlp.down_proj.weight",
        ),
    ] {
        let p = llama_gguf_with("nan", |_, t| {
            let t = t.iter_mut().find(|t| t.name == name).unwrap();
            t.data[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        });
        let e = load_err(&p);
        assert!(
            e.contains(&format!("tensor {name} ({hf}) holds a non-finite value")),
            "{e}"
        );
    }
}

/// token_embd's rows must be the vocabulary's size (tokenizer.ggml.tokens), as llama.cpp
/// requires.
#[test]
fn token_embd_rows_must_match_the_vocabulary() {
    let tokens = |n: usize| {
        Some(MetaValue::Array(
            (0..n).map(|i| MetaValue::String(format!("t{i}"))).collect(),
        ))
    };
    let p = llama_gguf_with("vocab", |m, _| {
        set_key(m, "tokenizer.ggml.tokens", tokens(200));
    });
    let e = load_err(&p);
    assert!(
        e.contains("token_embd.weight has 256 rows")
            && e.contains("(tokenizer.ggml.tokens) has 200 tokens"),
        "{e}"
    );
    loads(&llama_gguf_with("vocab-ok", |m, _| {
        set_key(m, "tokenizer.ggml.tokens", tokens(256));
    }));
}

/// A damaged copy of the built-in model says where it is and how to get a good one: deleting
/// the cached file (lorafit fetches it again), or fixing LORAFIT_SMOLLM2_GGUF.
#[test]
fn damaged_builtin_model_says_how_to_replace_it() {
    let cache = std::env::temp_dir().join(format!(
        "lorafit-gguf-test-{}-builtin-cache",
        std::process::id()
    ));
    let dir = cache.join("smollm2");
    std::fs::create_dir_all(&dir).unwrap();
    let full = std::fs::read(fixture("quant_ref.gguf")).unwrap();
    let cached = dir.join(lorafit::model::smollm2::FILE_NAME);
    std::fs::write(&cached, &full[..full.len() / 2]).unwrap();
    let elsewhere = cache.join("elsewhere.gguf");
    std::fs::write(&elsewhere, &full[..full.len() / 2]).unwrap();
    let run = |env_file: Option<&Path>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"));
        c.args([
            "generate",
            "--max-new-tokens",
            "1",
            "--model",
            "smollm2",
            "hi",
        ])
        .env("LORAFIT_CACHE", &cache)
        .env_remove("LORAFIT_SMOLLM2_GGUF");
        if let Some(f) = env_file {
            c.env("LORAFIT_SMOLLM2_GGUF", f);
        }
        let out = c.output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(None);
    assert!(
        e.contains(&format!("smollm2 ({}) is damaged", cached.display()))
            && e.contains("delete it and lorafit fetches it again"),
        "{e}"
    );
    let e = run(Some(&elsewhere));
    assert!(
        e.contains(&format!("smollm2 ({}) is damaged", elsewhere.display()))
            && e.contains("LORAFIT_SMOLLM2_GGUF points at it"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&cache);
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
