//! A minimal tar (POSIX ustar) writer for downloads: the regular files of one folder (an
//! adapter), or of a folder and its subfolders (an export's artefacts), sorted by name, under one
//! top-level folder name. Such a folder holds a handful of files (adapter_config.json,
//! adapter_model.safetensors, merged-hf/…), so a crate for the format would not pay for its
//! compile time.

use anyhow::{bail, Context, Result};
use std::path::Path;

const BLOCK: usize = 512;

/// Writes `value` as a NUL-terminated octal number filling `field`.
fn octal(field: &mut [u8], value: u64) -> Result<()> {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    if text.len() > digits {
        bail!("tar: {value} does not fit a {digits}-digit field");
    }
    field[..digits].copy_from_slice(text.as_bytes());
    field[digits] = 0;
    Ok(())
}

fn header(name: &str, size: u64, mode: u32, typeflag: u8, mtime: u64) -> Result<[u8; BLOCK]> {
    if name.len() > 100 {
        bail!("tar: name {name:?} is longer than 100 bytes");
    }
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], mode as u64)?;
    octal(&mut h[108..116], 0)?; // uid
    octal(&mut h[116..124], 0)?; // gid
    octal(&mut h[124..136], size)?;
    octal(&mut h[136..148], mtime)?;
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field read as spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| b as u64).sum();
    let text = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(text.as_bytes());
    Ok(h)
}

/// A tar archive of the regular files directly inside `dir`, as `prefix/<file>`.
pub fn tar_folder(dir: &Path, prefix: &str) -> Result<Vec<u8>> {
    archive(dir, prefix, false)
}

/// A tar archive of `dir` with its subfolders, as `prefix/<path>`.
pub fn tar_tree(dir: &Path, prefix: &str) -> Result<Vec<u8>> {
    archive(dir, prefix, true)
}

fn archive(dir: &Path, prefix: &str, recursive: bool) -> Result<Vec<u8>> {
    let mtime = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut out = Vec::new();
    append_folder(&mut out, dir, prefix, recursive, mtime)?;
    // End of archive: two zero blocks.
    out.resize(out.len() + 2 * BLOCK, 0);
    Ok(out)
}

fn append_folder(
    out: &mut Vec<u8>,
    dir: &Path,
    prefix: &str,
    recursive: bool,
    mtime: u64,
) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    out.extend_from_slice(&header(&format!("{prefix}/"), 0, 0o755, b'5', mtime)?);
    for e in entries {
        let kind = e.file_type()?;
        let name = e.file_name();
        let name = name
            .to_str()
            .with_context(|| format!("{}: a file name that is not UTF-8", dir.display()))?;
        if kind.is_dir() && recursive {
            append_folder(out, &e.path(), &format!("{prefix}/{name}"), true, mtime)?;
            continue;
        }
        if !kind.is_file() {
            continue;
        }
        let bytes =
            std::fs::read(e.path()).with_context(|| format!("reading {}", e.path().display()))?;
        out.extend_from_slice(&header(
            &format!("{prefix}/{name}"),
            bytes.len() as u64,
            0o644,
            b'0',
            mtime,
        )?);
        out.extend_from_slice(&bytes);
        out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
    }
    Ok(())
}

/// Reads an archive written by [`tar_folder`] back as (name, contents) of its regular files.
pub fn read_tar(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = Vec::new();
    let mut at = 0;
    while at + BLOCK <= bytes.len() {
        let h = &bytes[at..at + BLOCK];
        if h.iter().all(|&b| b == 0) {
            return Ok(files);
        }
        let field = |r: std::ops::Range<usize>| {
            let f = &h[r];
            let end = f.iter().position(|&b| b == 0).unwrap_or(f.len());
            String::from_utf8_lossy(&f[..end]).trim().to_string()
        };
        let name = field(0..100);
        let size = u64::from_str_radix(&field(124..136), 8)
            .with_context(|| format!("tar entry {name:?}: bad size"))? as usize;
        let stored: u64 = u64::from_str_radix(&field(148..156), 8)
            .with_context(|| format!("tar entry {name:?}: bad checksum field"))?;
        let sum: u64 = h
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    b as u64
                }
            })
            .sum();
        if sum != stored {
            bail!("tar entry {name:?}: checksum {stored} but the header sums to {sum}");
        }
        at += BLOCK;
        let end = at
            .checked_add(size)
            .filter(|&e| e <= bytes.len())
            .with_context(|| format!("tar entry {name:?}: truncated"))?;
        if h[156] == b'0' {
            files.push((name, bytes[at..end].to_vec()));
        }
        at += size.div_ceil(BLOCK) * BLOCK;
    }
    bail!("tar: no end-of-archive blocks")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folder_round_trips_with_valid_headers() {
        let dir = std::env::temp_dir().join(format!("lorafit-tar-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let big: Vec<u8> = (0..1300u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(dir.join("b.bin"), &big).unwrap();
        std::fs::write(dir.join("a.json"), b"{\"r\": 8}").unwrap();
        std::fs::write(dir.join("empty"), b"").unwrap();
        let tar = tar_folder(&dir, "adapter").unwrap();
        assert_eq!(tar.len() % BLOCK, 0);
        // dir header, a.json (1 + 1 blocks), b.bin (1 + 3), empty (1), two end blocks.
        assert_eq!(tar.len(), BLOCK * (1 + 2 + 4 + 1 + 2));
        assert_eq!(&tar[257..263], b"ustar\0");
        let files = read_tar(&tar).unwrap();
        let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(names, ["adapter/a.json", "adapter/b.bin", "adapter/empty"]);
        assert_eq!(files[0].1, b"{\"r\": 8}");
        assert_eq!(files[1].1, big);
        assert!(files[2].1.is_empty());
        // Sizes are octal: 1300 bytes is 2424.
        assert_eq!(&tar[3 * BLOCK + 124..3 * BLOCK + 136], b"00000002424\0");
        std::fs::write(dir.join("sub/c.txt"), b"c").unwrap();
        let tree = read_tar(&tar_tree(&dir, "export").unwrap()).unwrap();
        let names: Vec<&str> = tree.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "export/a.json",
                "export/b.bin",
                "export/empty",
                "export/sub/c.txt"
            ]
        );
        let mut bad = tar.clone();
        bad[BLOCK] ^= 1;
        assert!(read_tar(&bad).unwrap_err().to_string().contains("checksum"));
    }
}
