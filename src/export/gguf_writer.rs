//! A GGUF v3 writer: metadata key/values and tensors (raw ggml bytes with their type and dims)
//! into one file that llama.cpp, gguf-py and lorafit's own reader (`model::gguf`) parse.
//!
//! It exists for `lorafit export`: the GGUF LoRA adapter and the merged GGUF are both written
//! through it. Layout (ggml's `gguf.cpp`): magic `GGUF`, version 3, tensor count, metadata
//! count (u64 each), the key/values, the tensor table (name, dims fastest-first, type id,
//! offset into the data section), padding to `general.alignment` (32 unless the metadata sets
//! it), then each tensor's bytes at its offset, each padded to the alignment.

use crate::model::gguf::{GgmlType, MetaValue};
use anyhow::{bail, ensure, Context, Result};
use std::path::Path;

const DEFAULT_ALIGNMENT: usize = 32;

/// One tensor to write: `dims` in GGUF order (fastest-varying first, i.e. the PyTorch shape
/// reversed) and its data already encoded as `ggml_type`.
pub struct GgufTensor {
    pub name: String,
    pub dims: Vec<usize>,
    pub ggml_type: GgmlType,
    pub data: Vec<u8>,
}

impl GgufTensor {
    /// An f32 tensor from a PyTorch-order shape.
    pub fn f32(name: impl Into<String>, torch_shape: &[usize], data: &[f32]) -> GgufTensor {
        GgufTensor {
            name: name.into(),
            dims: torch_shape.iter().rev().copied().collect(),
            ggml_type: GgmlType::F32,
            data: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Metadata and tensors of a GGUF file, in the order they will be written.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<GgufTensor>,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Sets `key` (replacing an earlier value of the same key, keeping its place).
    pub fn set(&mut self, key: &str, value: MetaValue) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    pub fn set_str(&mut self, key: &str, value: &str) {
        self.set(key, MetaValue::String(value.to_string()));
    }

    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// Adds a tensor; its byte length must match its type and dims.
    pub fn add_tensor(&mut self, t: GgufTensor) -> Result<()> {
        let n: usize = t.dims.iter().product();
        let need = t.ggml_type.bytes_for(n).with_context(|| {
            format!(
                "tensor {}: {n} elements is not a whole number of {} blocks",
                t.name, t.ggml_type
            )
        })?;
        ensure!(
            t.data.len() == need,
            "tensor {}: {} bytes for {n} elements of {}, expected {need}",
            t.name,
            t.data.len(),
            t.ggml_type
        );
        ensure!(
            !self.tensors.iter().any(|o| o.name == t.name),
            "tensor {} added twice",
            t.name
        );
        self.tensors.push(t);
        Ok(())
    }

    fn alignment(&self) -> Result<usize> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, v)) => match v.as_usize() {
                Some(a) if a > 0 && a.is_power_of_two() => Ok(a),
                _ => bail!("general.alignment {v:?} is not a power of two"),
            },
        }
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let align = self.alignment()?;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            out.extend_from_slice(&value_type(v).to_le_bytes());
            write_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in &t.dims {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).next_multiple_of(align);
        }
        out.resize(out.len().next_multiple_of(align), 0);
        let data_start = out.len();
        for (t, &o) in self.tensors.iter().zip(&offsets) {
            out.resize(data_start + o, 0);
            out.extend_from_slice(&t.data);
        }
        out.resize(data_start + offset, 0);
        Ok(out)
    }

    /// Writes the file atomically (a temporary beside it, then a rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        crate::atomic_file::write(path, &self.to_bytes()?)
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// GGUF's value type ids (`gguf_type`).
fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => write_string(out, s),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array(items) => {
            // The element type of an empty array is not recoverable from a `MetaValue`; every
            // empty array lorafit copies (tokenizer lists) is a string array in llama.cpp's
            // files, so that is what is written.
            let elem = items.first().map(value_type).unwrap_or(8);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
    }
}
