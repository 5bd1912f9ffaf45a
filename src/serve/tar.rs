//! A minimal tar writer for downloads: the regular files of one folder (an adapter), or of a
//! folder and its subfolders (an export's artefacts), sorted by name, under one top-level folder
//! name, less a run's lock file (`run_folder::LOCK_FILE`). The archive is listed first
//! ([`Archive::folder`], [`Archive::tree`]), which gives its exact length and refuses what it
//! cannot hold before a byte is sent, then written file by file into any `Write`
//! ([`Archive::write_to`]), so that a download of many gigabytes is streamed rather than built
//! in memory. Headers are POSIX ustar; a name over 100 bytes or a file over ustar's 8 GiB gets a
//! PAX extended header (`path`, `size`) before its own, as GNU tar, bsdtar and Python's tarfile
//! read. Such a folder holds a handful of files, so a crate for the format would not pay for its
//! compile time.

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

const BLOCK: usize = 512;
/// The longest name a ustar header holds in its name field.
const NAME_LEN: usize = 100;
/// The largest size the 11 octal digits of a ustar header hold.
const MAX_USTAR_SIZE: u64 = 0o77777777777;

/// Writes `value` as a NUL-terminated octal number filling `field`.
fn octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    debug_assert!(
        text.len() <= digits,
        "{value} overflows a {digits}-digit field"
    );
    field[..digits].copy_from_slice(&text.as_bytes()[text.len().saturating_sub(digits)..]);
    field[digits] = 0;
}

/// A ustar header; `name` is cut to the field (a PAX header before it holds the whole one).
fn header(name: &str, size: u64, mode: u32, typeflag: u8, mtime: u64) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    let name = &name.as_bytes()[..name.len().min(NAME_LEN)];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], mode as u64);
    octal(&mut h[108..116], 0); // uid
    octal(&mut h[116..124], 0); // gid
    octal(&mut h[124..136], size.min(MAX_USTAR_SIZE));
    octal(&mut h[136..148], mtime);
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field read as spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| b as u64).sum();
    let text = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(text.as_bytes());
    h
}

/// One PAX record, `"<length> <key>=<value>\n"`, where the length counts the whole record,
/// its own digits included.
fn pax_record(key: &str, value: &str) -> String {
    let rest = key.len() + value.len() + 3; // the space, `=` and newline
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    format!("{len} {key}={value}\n")
}

/// The PAX records an entry needs: its name if it does not fit ustar's field, its size if it
/// does not fit ustar's digits; empty when ustar holds both.
fn pax_records(name: &str, size: u64) -> String {
    let mut records = String::new();
    if name.len() > NAME_LEN {
        records.push_str(&pax_record("path", name));
    }
    if size > MAX_USTAR_SIZE {
        records.push_str(&pax_record("size", &size.to_string()));
    }
    records
}

fn padded(len: u64) -> u64 {
    len.div_ceil(BLOCK as u64) * BLOCK as u64
}

/// One member of an archive: a folder (no source) or a regular file.
struct Entry {
    name: String,
    source: Option<PathBuf>,
    size: u64,
}

impl Entry {
    /// Bytes this entry takes in the archive: its PAX header and records if any, its header,
    /// its contents padded to whole blocks.
    fn archived_len(&self) -> u64 {
        let records = pax_records(&self.name, self.size).len() as u64;
        let pax = if records > 0 {
            BLOCK as u64 + padded(records)
        } else {
            0
        };
        pax + BLOCK as u64 + padded(self.size)
    }
}

/// The members of an archive, listed from disk, to be written by [`Archive::write_to`].
pub struct Archive {
    entries: Vec<Entry>,
    mtime: u64,
}

impl Archive {
    /// The regular files directly inside `dir`, as `prefix/<file>`.
    pub fn folder(dir: &Path, prefix: &str) -> Result<Archive> {
        Archive::list(dir, prefix, false)
    }

    /// `dir` with its subfolders, as `prefix/<path>`.
    pub fn tree(dir: &Path, prefix: &str) -> Result<Archive> {
        Archive::list(dir, prefix, true)
    }

    fn list(dir: &Path, prefix: &str, recursive: bool) -> Result<Archive> {
        let mtime = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut entries = Vec::new();
        list_folder(&mut entries, dir, prefix, recursive)?;
        Ok(Archive { entries, mtime })
    }

    /// The archive's length in bytes, end blocks included.
    pub fn len(&self) -> u64 {
        self.entries.iter().map(Entry::archived_len).sum::<u64>() + 2 * BLOCK as u64
    }

    /// Whether the archive has no members at all (not even its top-level folder).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Writes the archive into `out`, reading one file at a time; a file whose size changed
    /// since the listing is an error (the archive's length was promised).
    pub fn write_to(&self, out: &mut dyn Write) -> Result<()> {
        let zeros = [0u8; BLOCK];
        let pad = |out: &mut dyn Write, len: u64| -> std::io::Result<()> {
            out.write_all(&zeros[..(padded(len) - len) as usize])
        };
        for e in &self.entries {
            let records = pax_records(&e.name, e.size);
            if !records.is_empty() {
                out.write_all(&header(
                    "././@PaxHeader",
                    records.len() as u64,
                    0o644,
                    b'x',
                    self.mtime,
                ))?;
                out.write_all(records.as_bytes())?;
                pad(out, records.len() as u64)?;
            }
            let Some(source) = &e.source else {
                out.write_all(&header(&e.name, 0, 0o755, b'5', self.mtime))?;
                continue;
            };
            out.write_all(&header(&e.name, e.size, 0o644, b'0', self.mtime))?;
            let file = std::fs::File::open(source)
                .with_context(|| format!("reading {}", source.display()))?;
            // One byte past the size tells a file that grew from one that did not.
            let copied = std::io::copy(&mut file.take(e.size + 1), out)
                .with_context(|| format!("reading {}", source.display()))?;
            if copied != e.size {
                bail!(
                    "{} changed while it was being archived ({} bytes listed, {copied} read)",
                    source.display(),
                    e.size
                );
            }
            pad(out, e.size)?;
        }
        out.write_all(&[0u8; 2 * BLOCK])?;
        out.flush()?;
        Ok(())
    }
}

fn list_folder(entries: &mut Vec<Entry>, dir: &Path, prefix: &str, recursive: bool) -> Result<()> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    found.sort_by_key(|e| e.file_name());
    entries.push(Entry {
        name: format!("{prefix}/"),
        source: None,
        size: 0,
    });
    for e in found {
        let kind = e.file_type()?;
        let name = e.file_name();
        let name = name
            .to_str()
            .with_context(|| format!("{}: a file name that is not UTF-8", dir.display()))?;
        if kind.is_dir() && recursive {
            list_folder(entries, &e.path(), &format!("{prefix}/{name}"), true)?;
            continue;
        }
        // A run's lock file is no result, though a run leaves it in its folder.
        if !kind.is_file() || name == crate::train::run_folder::LOCK_FILE {
            continue;
        }
        let size = e
            .metadata()
            .with_context(|| format!("reading {}", e.path().display()))?
            .len();
        entries.push(Entry {
            name: format!("{prefix}/{name}"),
            source: Some(e.path()),
            size,
        });
    }
    Ok(())
}

/// The `path` and `size` records of a PAX extended header.
fn read_pax(data: &[u8]) -> Result<(Option<String>, Option<u64>)> {
    let (mut path, mut size) = (None, None);
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest
            .iter()
            .position(|&b| b == b' ')
            .context("tar: a PAX record without a length")?;
        let len: usize = std::str::from_utf8(&rest[..space])?
            .parse()
            .context("tar: a PAX record's length")?;
        if len <= space + 1 || len > rest.len() {
            bail!("tar: a PAX record of length {len} in {} bytes", rest.len());
        }
        let record = std::str::from_utf8(&rest[space + 1..len - 1])?;
        match record.split_once('=') {
            Some(("path", v)) => path = Some(v.to_string()),
            Some(("size", v)) => size = Some(v.parse().context("tar: a PAX size")?),
            _ => {}
        }
        rest = &rest[len..];
    }
    Ok((path, size))
}

/// Reads an archive written by [`Archive::write_to`] back as (name, contents) of its regular
/// files.
pub fn read_tar(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = Vec::new();
    let mut at = 0;
    let (mut long_name, mut long_size) = (None, None);
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
        let name = long_name.take().unwrap_or_else(|| field(0..100));
        let size = match long_size.take() {
            Some(s) => s,
            None => u64::from_str_radix(&field(124..136), 8)
                .with_context(|| format!("tar entry {name:?}: bad size"))?,
        } as usize;
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
        match h[156] {
            b'0' => files.push((name, bytes[at..end].to_vec())),
            b'x' => (long_name, long_size) = read_pax(&bytes[at..end])?,
            _ => {}
        }
        at += size.div_ceil(BLOCK) * BLOCK;
    }
    bail!("tar: no end-of-archive blocks")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archived(archive: &Archive) -> Vec<u8> {
        let mut out = Vec::new();
        archive.write_to(&mut out).unwrap();
        assert_eq!(
            out.len() as u64,
            archive.len(),
            "the listed length is the written one"
        );
        out
    }

    #[test]
    fn folder_round_trips_with_valid_headers() {
        let dir = std::env::temp_dir().join(format!("lorafit-tar-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let big: Vec<u8> = (0..1300u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(dir.join("b.bin"), &big).unwrap();
        std::fs::write(dir.join("a.json"), b"{\"r\": 8}").unwrap();
        std::fs::write(dir.join("empty"), b"").unwrap();
        let tar = archived(&Archive::folder(&dir, "adapter").unwrap());
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
        let tree = read_tar(&archived(&Archive::tree(&dir, "export").unwrap())).unwrap();
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
        // A run's lock file, left in its folder, is not archived.
        std::fs::write(dir.join(crate::train::run_folder::LOCK_FILE), b"1\n").unwrap();
        let locked = read_tar(&archived(&Archive::tree(&dir, "export").unwrap())).unwrap();
        let locked_names: Vec<&str> = locked.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(locked_names, names);
        let mut bad = tar.clone();
        bad[BLOCK] ^= 1;
        assert!(read_tar(&bad).unwrap_err().to_string().contains("checksum"));

        // A file that grows after the listing is refused, not archived with a wrong length.
        let listed = Archive::folder(&dir, "adapter").unwrap();
        std::fs::write(dir.join("empty"), b"now something").unwrap();
        let e = listed.write_to(&mut Vec::new()).unwrap_err();
        assert!(format!("{e:#}").contains("changed while"), "{e:#}");
    }

    #[test]
    fn names_longer_than_ustar_holds_get_a_pax_header() {
        let dir = std::env::temp_dir().join(format!("lorafit-tar-long-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let deep = format!("{}/{}", "d".repeat(120), "e".repeat(90));
        std::fs::create_dir_all(dir.join(&deep)).unwrap();
        let file = format!("{deep}/{}.bin", "f".repeat(150));
        std::fs::write(dir.join(&file), b"deep contents").unwrap();
        let tar = archived(&Archive::tree(&dir, "job-7-export").unwrap());
        let files = read_tar(&tar).unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].0, format!("job-7-export/{file}"));
        assert!(files[0].0.len() > 360, "{}", files[0].0.len());
        assert_eq!(files[0].1, b"deep contents");
        // The extended header comes first and is its own member.
        assert_eq!(tar[BLOCK + 156], b'x');
    }

    #[test]
    fn pax_records_count_their_own_length() {
        for value_len in [0, 1, 5, 6, 7, 90, 95, 96, 97, 98, 990, 995, 996, 997] {
            let record = pax_record("path", &"a".repeat(value_len));
            let (len, _) = record.split_once(' ').unwrap();
            assert_eq!(len.parse::<usize>().unwrap(), record.len(), "{record:?}");
        }
        let (path, size) = read_pax(
            format!(
                "{}{}",
                pax_record("path", "x/y"),
                pax_record("size", "9000000000")
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!((path.as_deref(), size), (Some("x/y"), Some(9_000_000_000)));
        assert_eq!(pax_records("short", 10), "");
        assert!(pax_records("short", MAX_USTAR_SIZE + 1).contains(" size=8589934592\n"));
    }
}
