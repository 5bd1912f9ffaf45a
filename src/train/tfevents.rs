//! TensorBoard's event-file format, written directly (it is small): a file of records, each
//! `u64 length, u32 masked CRC-32C of the length, the bytes, u32 masked CRC-32C of the bytes`,
//! whose bytes are `Event` protocol buffers (tensorflow/core/util/event.proto): a version event
//! first, then one event per step holding scalar summaries. Only the protobuf fields written
//! here are encoded (`Event.wall_time` 1, `step` 2, `file_version` 3, `summary` 5,
//! `session_log` 6; `Summary.value` 1; `Value.tag` 1, `simple_value` 2; `SessionLog.status` 1).

use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: records are small.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// An `Event` with its wall time and step, then `rest` (already-encoded further fields).
fn event(wall_time: f64, step: i64, rest: &[u8]) -> Vec<u8> {
    let mut e = Vec::new();
    varint(&mut e, 1 << 3 | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    varint(&mut e, 2 << 3);
    varint(&mut e, step as u64);
    e.extend_from_slice(rest);
    e
}

/// The `Event` bytes of scalar summaries `(tag, value)` at `step`.
pub fn scalar_event(wall_time: f64, step: i64, values: &[(String, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, v) in values {
        let mut value = Vec::new();
        bytes_field(&mut value, 1, tag.as_bytes());
        varint(&mut value, 2 << 3 | 5);
        value.extend_from_slice(&(*v as f32).to_le_bytes());
        bytes_field(&mut summary, 1, &value);
    }
    let mut rest = Vec::new();
    bytes_field(&mut rest, 5, &summary);
    event(wall_time, step, &rest)
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An open event file; every event is flushed with one write.
pub struct EventWriter {
    file: std::fs::File,
    path: PathBuf,
}

impl EventWriter {
    /// `events.out.tfevents.<unix seconds>.lorafit.<start step>` in `dir`, begun with the
    /// version event.
    pub fn create(dir: &Path, start_step: usize) -> Result<EventWriter> {
        let path = dir.join(format!(
            "events.out.tfevents.{}.lorafit.{start_step}",
            now() as u64
        ));
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = EventWriter { file, path };
        let mut rest = Vec::new();
        bytes_field(&mut rest, 3, b"brain.Event:2");
        w.write(&event(now(), 0, &rest))?;
        Ok(w)
    }

    fn write(&mut self, event: &[u8]) -> Result<()> {
        self.file
            .write_all(&record(event))
            .with_context(|| format!("writing {}", self.path.display()))
    }

    pub fn scalars(&mut self, step: i64, values: &[(String, f64)]) -> Result<()> {
        self.write(&scalar_event(now(), step, values))
    }

    /// `SessionLog { status: START }` at `step`: TensorBoard then discards events of later
    /// steps that earlier files of the run hold.
    pub fn session_start(&mut self, step: i64) -> Result<()> {
        let mut log = Vec::new();
        varint(&mut log, 1 << 3);
        varint(&mut log, 1);
        let mut rest = Vec::new();
        bytes_field(&mut rest, 6, &log);
        self.write(&event(now(), step, &rest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        // RFC 3720 B.4 and the usual check value of "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn a_scalar_event_encodes_as_protobuf() {
        let e = scalar_event(0.5, 3, &[("train/loss".to_string(), 1.5)]);
        let mut want = vec![0x09];
        want.extend_from_slice(&0.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 3, 0x2a, 19, 0x0a, 17, 0x0a, 10]);
        want.extend_from_slice(b"train/loss");
        want.push(0x15);
        want.extend_from_slice(&1.5f32.to_le_bytes());
        assert_eq!(e, want);
        let r = record(&e);
        assert_eq!(&r[..8], &(e.len() as u64).to_le_bytes());
        assert_eq!(&r[r.len() - 4..], &masked_crc32c(&e).to_le_bytes());
    }
}
