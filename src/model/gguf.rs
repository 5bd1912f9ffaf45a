//! GGUF v2/v3 reader: memory-maps a llama.cpp model file, parses its header,
//! metadata and tensor table, and dequantizes tensors to `f32` so lorafit can
//! train LoRA adapters directly on top of GGUF base models.
//!
//! # Notes for the integrator
//!
//! * Every error produced while parsing names the file path, and every
//!   per-tensor error also names the tensor. Bad input never panics: all
//!   offsets and sizes are bounds-checked with overflow-checked arithmetic.
//! * GGUF dims are listed fastest-first: `shape[0]` (ggml's `ne0`) is the
//!   contiguous dimension. For a 2-D weight this is the REVERSE of the PyTorch
//!   shape: a Hugging Face `nn.Linear` weight `[out_features, in_features]`
//!   shows up as GGUF dims `[in_features, out_features]`; the bytes are
//!   identical to a row-major `[out, in]` matrix (`rows = shape[1]`,
//!   `cols = shape[0]`).
//! * Tensor names (llama architecture) → Hugging Face names:
//!   - `token_embd.weight` → `model.embed_tokens.weight`
//!   - `blk.N.attn_norm.weight` → `model.layers.N.input_layernorm.weight`
//!   - `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight` (permuted, see below)
//!   - `blk.N.attn_k.weight` → `model.layers.N.self_attn.k_proj.weight` (permuted, see below)
//!   - `blk.N.attn_v.weight` → `model.layers.N.self_attn.v_proj.weight`
//!   - `blk.N.attn_output.weight` → `model.layers.N.self_attn.o_proj.weight`
//!   - `blk.N.ffn_norm.weight` → `model.layers.N.post_attention_layernorm.weight`
//!   - `blk.N.ffn_gate.weight` → `model.layers.N.mlp.gate_proj.weight`
//!   - `blk.N.ffn_up.weight` → `model.layers.N.mlp.up_proj.weight`
//!   - `blk.N.ffn_down.weight` → `model.layers.N.mlp.down_proj.weight`
//!   - `output_norm.weight` → `model.norm.weight`
//!   - `output.weight` → `lm_head.weight` (absent when embeddings are tied,
//!     as in SmolLM2-135M: then reuse `token_embd.weight`)
//! * llama.cpp's `convert_hf_to_gguf.py` (LlamaModel) PERMUTES THE ROWS of the
//!   q_proj and k_proj weights (`reshape(n_head, 2, rows/n_head/2, cols)
//!   .swapaxes(1, 2)`) to turn HF's "rotate-half" RoPE layout into ggml's
//!   interleaved-pair layout. To get Hugging Face weights back call
//!   [`unpermute_qk_rows`] on the dequantized row-major `[rows, cols]` data
//!   with `n_head = llama.attention.head_count` for `attn_q` and
//!   `n_head = llama.attention.head_count_kv` for `attn_k` (the converter uses
//!   n_head_kv for k whenever it differs from n_head). `attn_v`,
//!   `attn_output` and the MLP weights are not permuted.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use half::f16;
use memmap2::Mmap;
use rayon::prelude::*;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
/// Blocks per rayon task when dequantizing large tensors.
const PAR_BLOCKS_PER_TASK: usize = 1024;
/// Tensors with fewer elements than this are dequantized on the calling thread.
const PAR_MIN_ELEMENTS: usize = 1 << 16;
/// Upper bound on dimensions per tensor (ggml's GGML_MAX_DIMS is 4).
const MAX_DIMS: u32 = 8;

/// ggml tensor element types (ids as in ggml.h `enum ggml_type`).
///
/// All known types can be listed and their raw bytes read with
/// [`GgufFile::tensor_bytes`]; only the types for which
/// [`GgmlType::can_dequantize`] is true can be converted to `f32`.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

impl GgmlType {
    /// Maps a ggml type id; `None` for ids this reader does not know.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1_M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            _ => return None,
        })
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// Elements per block (1 for plain float/int types).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Whether [`dequantize`] supports this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q4_K | Q6_K)
    }

    /// Bytes needed for `n_elements` values, or `None` if `n_elements` is not
    /// a whole number of blocks (or overflows).
    pub fn bytes_for(self, n_elements: usize) -> Option<usize> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        (n_elements / self.block_size()).checked_mul(self.type_size())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self)
    }
}

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Human-readable type name for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// Any integer value widened to i128 (lossless for every GGUF int type).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v as i128,
            MetaValue::I8(v) => v as i128,
            MetaValue::U16(v) => v as i128,
            MetaValue::I16(v) => v as i128,
            MetaValue::U32(v) => v as i128,
            MetaValue::I32(v) => v as i128,
            MetaValue::U64(v) => v as i128,
            MetaValue::I64(v) => v as i128,
            _ => return None,
        })
    }

    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }
    pub fn as_usize(&self) -> Option<usize> {
        self.as_i128().and_then(|v| usize::try_from(v).ok())
    }
    /// Floats, or integers converted to f32.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetaValue::F32(v) => Some(v),
            MetaValue::F64(v) => Some(v as f32),
            _ => self.as_i128().map(|v| v as f32),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF dims, fastest-varying first (`shape[0]` = ggml `ne0`, contiguous).
    /// Reverse it to get the PyTorch shape.
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Byte offset relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Total number of elements (product of dims; validated at open time).
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size of the tensor's data in bytes (validated at open time).
    pub fn byte_size(&self) -> usize {
        self.ggml_type.bytes_for(self.n_elements()).unwrap_or(0)
    }
    /// Shape in PyTorch order (slowest first), e.g. `[out, in]` for a linear weight.
    pub fn torch_shape(&self) -> Vec<usize> {
        self.shape.iter().rev().copied().collect()
    }
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .finish()
    }
}

/// Bounds-checked little-endian cursor over the mapped header.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                anyhow!(
                    "truncated file: need {n} bytes for {what} at offset {}, file has {} bytes",
                    self.pos,
                    self.buf.len()
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }
    /// A u64 length/count that must fit in usize.
    fn len(&mut self, what: &str) -> Result<usize> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| anyhow!("{what} {v} does not fit in usize"))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        // GGUF strings are specified as UTF-8; stay lenient like llama.cpp.
        Ok(match std::str::from_utf8(bytes) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(bytes).into_owned(),
        })
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8(what)?),
            1 => MetaValue::I8(self.u8(what)? as i8),
            2 => MetaValue::U16(self.u16(what)?),
            3 => MetaValue::I16(self.u16(what)? as i16),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(self.u32(what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            7 => {
                let b = self.u8(what)?;
                if b > 1 {
                    bail!("{what}: invalid bool byte {b}");
                }
                MetaValue::Bool(b == 1)
            }
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    bail!("{what}: arrays nested too deeply");
                }
                let elem_ty = self.u32(what)?;
                let n = self.len(what)?;
                // Every element takes at least one byte: refuse absurd counts
                // before allocating.
                if n > self.remaining() {
                    bail!(
                        "truncated file: {what} claims {n} array elements but only {} bytes remain",
                        self.remaining()
                    );
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem_ty, what, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(self.u64(what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            t => bail!("{what}: unknown metadata value type {t}"),
        })
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`. Validates that every tensor has a known
    /// type, a sane shape and lies entirely inside the file, and that its data,
    /// at the size its type and shape imply, fills its place in the data section
    /// (up to the next tensor, less the alignment padding).
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .with_context(|| format!("GGUF {}: cannot open file", path.display()))?;
        // SAFETY: the file is opened read-only; lorafit does not modify model
        // files while they are mapped. (Concurrent truncation by another
        // process is the usual, accepted mmap caveat.)
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("GGUF {}: cannot mmap file", path.display()))?;
        Self::parse(path.to_path_buf(), mmap)
            .with_context(|| format!("GGUF {}: invalid file", path.display()))
    }

    fn parse(path: PathBuf, mmap: Mmap) -> Result<Self> {
        let mut c = Cursor { buf: &mmap, pos: 0 };
        let magic = c.array::<4>("magic")?;
        if &magic != GGUF_MAGIC {
            if let Some(name) = ggml_magic(&magic) {
                bail!(
                    "a pre-GGUF GGML file (magic '{name}'), the format llama.cpp used before GGUF \
                     (August 2023); lorafit reads GGUF only: convert it with llama.cpp's \
                     convert_llama_ggml_to_gguf.py, or convert the original model with \
                     convert_hf_to_gguf.py"
                );
            }
            if &magic == b"FUGG" {
                bail!("{}", BIG_ENDIAN);
            }
            bail!(
                "bad magic {:02x?} (expected \"GGUF\"); not a GGUF file",
                magic
            );
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            // gguf-py writes the magic as "GGUF" in either byte order, the version in the file's.
            if (1..=3).contains(&version.swap_bytes()) {
                bail!(
                    "{BIG_ENDIAN} (its version field reads {version} little-endian, {} \
                     big-endian)",
                    version.swap_bytes()
                );
            }
            bail!("unsupported GGUF version {version} (only v2 and v3 are supported)");
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;

        let mut metadata = Vec::new();
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&format!("type of metadata '{key}'"))?;
            let value = c.value(ty, &format!("metadata '{key}'"), 0)?;
            meta_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                let a = v
                    .as_usize()
                    .ok_or_else(|| anyhow!("general.alignment has type {}", v.type_name()))?;
                if a == 0 || !a.is_power_of_two() {
                    bail!("general.alignment {a} is not a power of two");
                }
                a
            }
        };

        let mut tensors = Vec::new();
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("name of tensor #{i}"))?;
            let what = format!("tensor '{name}'");
            let n_dims = c.u32(&what)?;
            if n_dims > MAX_DIMS {
                bail!("{what}: {n_dims} dimensions (max {MAX_DIMS})");
            }
            let mut shape = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                shape.push(c.len(&what)?);
            }
            let type_id = c.u32(&what)?;
            let ggml_type = GgmlType::from_id(type_id)
                .ok_or_else(|| anyhow!("{what}: unknown ggml type id {type_id}"))?;
            let offset = c.u64(&what)?;
            let n_el = shape
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| anyhow!("{what}: shape {shape:?} overflows"))?;
            if ggml_type.bytes_for(n_el).is_none() {
                bail!(
                    "{what}: {n_el} elements of type {ggml_type} is not a whole number of \
                     {}-element blocks (shape {shape:?})",
                    ggml_type.block_size()
                );
            }
            if !offset.is_multiple_of(alignment as u64) {
                bail!("{what}: data offset {offset} is not a multiple of alignment {alignment}");
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                bail!("duplicate tensor name '{name}'");
            }
            tensors.push(TensorInfo {
                name,
                shape,
                ggml_type,
                offset,
            });
        }

        let data_start = c
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| anyhow!("data section offset overflows"))?;
        let file_len = mmap.len();
        if data_start > file_len && !tensors.is_empty() {
            bail!("truncated file: data section would start at {data_start} but file has {file_len} bytes");
        }
        check_layout(&tensors, file_len.saturating_sub(data_start), alignment)?;
        for t in &tensors {
            let size = t.byte_size();
            let end = usize::try_from(t.offset)
                .ok()
                .and_then(|o| o.checked_add(data_start))
                .and_then(|s| s.checked_add(size));
            match end {
                Some(e) if e <= file_len => {}
                _ => bail!(
                    "tensor '{}' ({} with dims {:?}: {} bytes) at data offset {} (data start {}) \
                     extends past end of file ({} bytes); file truncated, or its type or dims \
                     changed?",
                    t.name,
                    t.ggml_type,
                    t.shape,
                    size,
                    t.offset,
                    data_start,
                    file_len
                ),
            }
        }

        Ok(GgufFile {
            path,
            mmap,
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment,
            data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// Absolute file offset of the tensor data section.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// Raw metadata lookup.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.get(key).ok_or_else(|| {
            anyhow!(
                "GGUF {}: metadata key '{key}' is missing",
                self.path.display()
            )
        })
    }

    fn wrong_type(&self, key: &str, v: &MetaValue, want: &str) -> anyhow::Error {
        anyhow!(
            "GGUF {}: metadata '{key}' has type {} (value {}), expected {want}",
            self.path.display(),
            v.type_name(),
            short_debug(v)
        )
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong_type(key, v, "string"))
    }
    /// Any integer type that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        v.as_u32().ok_or_else(|| self.wrong_type(key, v, "u32"))
    }
    /// Any integer type that fits in usize.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.require(key)?;
        v.as_usize().ok_or_else(|| self.wrong_type(key, v, "usize"))
    }
    /// f32, f64 (narrowed) or any integer.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| self.wrong_type(key, v, "f32"))
    }
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong_type(key, v, "bool"))
    }
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|a| a.iter().map(MetaValue::as_str).collect::<Option<Vec<_>>>())
            .ok_or_else(|| self.wrong_type(key, v, "array of strings"))
    }
    /// Array of any integer type whose values fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|a| a.iter().map(MetaValue::as_i32).collect::<Option<Vec<_>>>())
            .ok_or_else(|| self.wrong_type(key, v, "array of i32"))
    }
    /// Array of floats (or integers, converted).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|a| a.iter().map(MetaValue::as_f32).collect::<Option<Vec<_>>>())
            .ok_or_else(|| self.wrong_type(key, v, "array of f32"))
    }
    /// `general.architecture`, e.g. "llama".
    pub fn arch(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| {
                anyhow!(
                    "GGUF {}: tensor '{name}' not found ({} tensors in file)",
                    self.path.display(),
                    self.tensors.len()
                )
            })
    }

    /// The raw (possibly quantized) bytes of a tensor.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor_info(name)?;
        // Bounds were validated in `parse`; re-check anyway so this can never panic.
        let start = usize::try_from(t.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_start));
        let end = start.and_then(|s| s.checked_add(t.byte_size()));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.mmap.len() => Ok(&self.mmap[s..e]),
            _ => bail!(
                "GGUF {}: tensor '{name}' data extends past end of file",
                self.path.display()
            ),
        }
    }

    /// Dequantizes a whole tensor to f32 (GGUF element order: `shape[0]`
    /// fastest, i.e. row-major over the reversed/PyTorch shape).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor_info(name)?;
        let n = t.n_elements();
        if !t.ggml_type.can_dequantize() {
            bail!(
                "GGUF {}: tensor '{name}' has unsupported type {} (supported: F32, F16, BF16, \
                 Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)",
                self.path.display(),
                t.ggml_type
            );
        }
        let bytes = self.tensor_bytes(name)?;
        let mut out = vec![0f32; n];
        dequantize(t.ggml_type, bytes, n, &mut out).with_context(|| {
            format!("GGUF {}: dequantizing tensor '{name}'", self.path.display())
        })?;
        Ok(out)
    }
}

const BIG_ENDIAN: &str = "a big-endian GGUF; lorafit reads little-endian GGUF files only: \
     convert it with gguf-py's gguf-convert-endian (`gguf-convert-endian FILE little`)";

/// The pre-GGUF GGML formats, by their magic (a u32 written little-endian, so "ggjt" is
/// stored as "tjgg"; either order is recognized).
fn ggml_magic(magic: &[u8; 4]) -> Option<&'static str> {
    let mut reversed = *magic;
    reversed.reverse();
    ["ggml", "ggmf", "ggjt"]
        .into_iter()
        .find(|name| name.as_bytes() == magic || name.as_bytes() == reversed)
}

/// Every GGUF writer (gguf-py, ggml's gguf.cpp) lays the tensors' data out back to back, each
/// padded to the alignment, so in offset order each tensor's data, at the size its type and
/// dims imply, must end before the next tensor's offset, less than one alignment short of it
/// (the last tensor: of the end of the data section). A type or dims edited after writing
/// breaks this, and would otherwise read another tensor's bytes or misread its own. Where the
/// file ends before the next tensor starts (or the last tensor ends), the file is truncated:
/// left to the end-of-file check.
fn check_layout(tensors: &[TensorInfo], data_len: usize, alignment: usize) -> Result<()> {
    let data_len = data_len as u64;
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| (t.offset, t.byte_size()));
    for (i, t) in by_offset.iter().enumerate() {
        let next = by_offset.get(i + 1);
        let limit = next.map_or(data_len, |n| n.offset);
        let need = t.byte_size() as u64;
        if limit > data_len || t.offset > limit {
            break;
        }
        let given = limit - t.offset;
        if next.is_none() && need > given {
            break;
        }
        if need <= given && given - need < alignment as u64 {
            continue;
        }
        let upto = match next {
            Some(n) => format!(
                "the next tensor, '{}', starts at data offset {}",
                n.name, n.offset
            ),
            None => format!("the data section ends at {data_len}"),
        };
        bail!(
            "tensor '{}' is {} with dims {:?}, which takes {need} bytes, but the file gives it \
             {given} bytes (it starts at data offset {} and {upto}; writers pad each tensor to \
             the alignment {alignment}): its type or dims do not match its data",
            t.name,
            t.ggml_type,
            t.shape,
            t.offset
        );
    }
    Ok(())
}

fn short_debug(v: &MetaValue) -> String {
    let mut s = format!("{v:?}");
    if s.len() > 80 {
        let mut cut = 80;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes one block of `ty` (`src.len() == type_size`,
/// `dst.len() == block_size`). Arithmetic mirrors ggml-quants.c
/// `dequantize_row_*` operation for operation, so the results are
/// bit-identical to ggml's reference C semantics and to gguf-py (verified by
/// tests/gguf_reader.rs with max |diff| == 0). Rust never contracts `a * b + c`
/// into a fused multiply-add, and neither does numpy; a ggml binary built with
/// FMA contraction could differ by <= 1 ulp on Q4_1 / Q4_K only.
fn dequant_block(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => dst[0] = f32::from_le_bytes([src[0], src[1], src[2], src[3]]),
        GgmlType::F16 => dst[0] = f16_at(src, 0),
        GgmlType::BF16 => {
            dst[0] = f32::from_bits((u16::from_le_bytes([src[0], src[1]]) as u32) << 16)
        }
        GgmlType::Q8_0 => {
            // block_q8_0 { f16 d; int8 qs[32]; }   y = qs * d
            let d = f16_at(src, 0);
            for (y, &q) in dst.iter_mut().zip(&src[2..34]) {
                *y = (q as i8) as f32 * d;
            }
        }
        GgmlType::Q4_0 => {
            // block_q4_0 { f16 d; u8 qs[16]; } low nibbles -> y[0..16], high -> y[16..32]
            let d = f16_at(src, 0);
            let qs = &src[2..18];
            for j in 0..16 {
                let x0 = (qs[j] & 0x0F) as i32 - 8;
                let x1 = (qs[j] >> 4) as i32 - 8;
                dst[j] = x0 as f32 * d;
                dst[j + 16] = x1 as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            // block_q4_1 { f16 d; f16 m; u8 qs[16]; }   y = q * d + m
            let d = f16_at(src, 0);
            let m = f16_at(src, 2);
            let qs = &src[4..20];
            for j in 0..16 {
                let x0 = (qs[j] & 0x0F) as f32;
                let x1 = (qs[j] >> 4) as f32;
                dst[j] = x0 * d + m;
                dst[j + 16] = x1 * d + m;
            }
        }
        GgmlType::Q4_K => {
            // block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }
            let d = f16_at(src, 0);
            let min = f16_at(src, 2);
            let scales = &src[4..16];
            let qs = &src[16..144];
            for g in 0..4 {
                // 64 outputs per group: 32 low nibbles then 32 high nibbles.
                let (sc1, m1) = scale_min_k4(2 * g, scales);
                let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                let d1 = d * sc1 as f32;
                let m1 = min * m1 as f32;
                let d2 = d * sc2 as f32;
                let m2 = min * m2 as f32;
                let q = &qs[32 * g..32 * g + 32];
                let y = &mut dst[64 * g..64 * g + 64];
                for l in 0..32 {
                    y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                    y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        GgmlType::Q6_K => {
            // block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }
            let d = f16_at(src, 208);
            for n in 0..2 {
                let ql = &src[64 * n..64 * n + 64];
                let qh = &src[128 + 32 * n..128 + 32 * n + 32];
                let sc = &src[192 + 8 * n..192 + 8 * n + 8];
                let y = &mut dst[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    // ggml: d * sc[is] * q  evaluates as (d * sc) * q
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        _ => unreachable!("dequant_block called for unsupported type"),
    }
}

/// ggml's `get_scale_min_k4`: 6-bit scale and min number `j` (0..8) of a
/// Q4_K/Q5_K super-block.
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn dequant_blocks(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let bs = ty.block_size();
    let ts = ty.type_size();
    match ty {
        // Fast paths for the element-wise types.
        GgmlType::F32 => {
            for (y, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (y, b) in dst.chunks_exact_mut(bs).zip(src.chunks_exact(ts)) {
                dequant_block(ty, b, y);
            }
        }
    }
}

/// Dequantizes `n_elements` values of type `ty` from `bytes` into
/// `out[..n_elements]`, bit-exactly as ggml's `dequantize_row_*` reference
/// code. Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.
///
/// Errors (never panics) when the type is unsupported, `n_elements` is not a
/// multiple of the block size, `bytes.len()` is not exactly the size of
/// `n_elements` values, or `out` is too short. Large inputs are processed in
/// parallel with rayon.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize, out: &mut [f32]) -> Result<()> {
    if !ty.can_dequantize() {
        bail!(
            "unsupported ggml type {ty} (id {}) for dequantization (supported: F32, F16, BF16, \
             Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)",
            ty.id()
        );
    }
    let need = ty.bytes_for(n_elements).ok_or_else(|| {
        anyhow!(
            "{n_elements} elements is not a multiple of the {ty} block size {}",
            ty.block_size()
        )
    })?;
    if bytes.len() != need {
        bail!(
            "{ty} data for {n_elements} elements must be {need} bytes, got {}",
            bytes.len()
        );
    }
    if out.len() < n_elements {
        bail!(
            "output buffer holds {} values, need {n_elements}",
            out.len()
        );
    }
    let out = &mut out[..n_elements];
    let bs = ty.block_size();
    let ts = ty.type_size();
    if n_elements < PAR_MIN_ELEMENTS {
        dequant_blocks(ty, bytes, out);
    } else {
        // For element-wise types a "block" is one value: use bigger tasks.
        let blocks_per_task = if bs == 1 {
            PAR_BLOCKS_PER_TASK * 32
        } else {
            PAR_BLOCKS_PER_TASK
        };
        out.par_chunks_mut(bs * blocks_per_task)
            .zip(bytes.par_chunks(ts * blocks_per_task))
            .for_each(|(dst, src)| dequant_blocks(ty, src, dst));
    }
    Ok(())
}

/// Applies llama.cpp's q/k row permutation (convert_hf_to_gguf.py
/// `LlamaModel.permute`): `w.reshape(n_head, 2, rows/n_head/2, cols)
/// .swapaxes(1, 2).reshape(rows, cols)`. Row `h*hd + i*half + j` of the HF
/// layout moves to row `h*hd + 2*j + i`. Mostly useful for tests and for
/// exporting back to GGUF.
pub fn permute_qk_rows(data: &mut [f32], rows: usize, cols: usize, n_head: usize) -> Result<()> {
    qk_rows(data, rows, cols, n_head, false)
}

/// Inverts llama.cpp's q/k row permutation, turning a GGUF `attn_q`/`attn_k`
/// weight (dequantized, row-major `[rows, cols]` = PyTorch `[out, in]`) back
/// into Hugging Face's layout. Pass `n_head = head_count` for q and
/// `n_head = head_count_kv` for k.
pub fn unpermute_qk_rows(data: &mut [f32], rows: usize, cols: usize, n_head: usize) -> Result<()> {
    qk_rows(data, rows, cols, n_head, true)
}

fn qk_rows(data: &mut [f32], rows: usize, cols: usize, n_head: usize, inverse: bool) -> Result<()> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        bail!("q/k permutation: {rows} rows is not divisible by 2 * n_head ({n_head})");
    }
    if rows.checked_mul(cols) != Some(data.len()) {
        bail!(
            "q/k permutation: data has {} values, expected {rows} x {cols}",
            data.len()
        );
    }
    let hd = rows / n_head;
    let half = hd / 2;
    let src = data.to_vec();
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..half {
                let hf_row = h * hd + i * half + j;
                let gguf_row = h * hd + 2 * j + i;
                let (from, to) = if inverse {
                    (gguf_row, hf_row)
                } else {
                    (hf_row, gguf_row)
                };
                data[to * cols..(to + 1) * cols]
                    .copy_from_slice(&src[from * cols..(from + 1) * cols]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straight re-implementation of numpy's
    /// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)`
    /// by index arithmetic on the 4-D array, independent of `qk_rows`.
    fn numpy_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
        let half = rows / n_head / 2;
        // source array A[h][i][j][c] (shape n_head,2,half,cols);
        // swapaxes gives B[h][j][i][c] = A[h][i][j][c], flattened row-major.
        let mut out = vec![0.0; w.len()];
        let mut k = 0;
        for h in 0..n_head {
            for j in 0..half {
                for i in 0..2 {
                    for c in 0..cols {
                        let a = ((h * 2 + i) * half + j) * cols + c;
                        out[k] = w[a];
                        k += 1;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn permute_unpermute_roundtrip() {
        for &(rows, cols, n_head) in &[
            (576usize, 3usize, 9usize),
            (192, 5, 3),
            (8, 2, 2),
            (4, 1, 1),
        ] {
            let orig: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
            let permuted = numpy_permute(&orig, rows, cols, n_head);
            let mut ours = orig.clone();
            permute_qk_rows(&mut ours, rows, cols, n_head).unwrap();
            assert_eq!(ours, permuted, "permute matches numpy semantics");
            let mut back = permuted.clone();
            unpermute_qk_rows(&mut back, rows, cols, n_head).unwrap();
            assert_eq!(back, orig, "unpermute(permute(x)) == x");
            if rows > 4 {
                assert_ne!(permuted, orig);
            }
        }
        let mut bad = vec![0f32; 10];
        assert!(unpermute_qk_rows(&mut bad, 5, 2, 2).is_err());
        assert!(unpermute_qk_rows(&mut bad, 4, 2, 1).is_err());
        assert!(unpermute_qk_rows(&mut bad, 4, 2, 0).is_err());
    }

    #[test]
    fn type_table() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
        assert_eq!(GgmlType::Q4_K.type_size(), 2 + 2 + 12 + 128);
        assert_eq!(GgmlType::Q6_K.type_size(), 128 + 64 + 16 + 2);
    }

    #[test]
    fn dequantize_rejects_bad_sizes() {
        let mut out = vec![0f32; 64];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], 32, &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], 31, &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34 * 4], 128, &mut out).is_err());
        let e = dequantize(GgmlType::Q5_0, &[0u8; 22], 32, &mut out).unwrap_err();
        assert!(e.to_string().contains("Q5_0"), "{e}");
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], 32, &mut out).is_ok());
    }
}
