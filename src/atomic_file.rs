//! Files written whole or not at all: the bytes go to a temporary beside the file, which is
//! renamed into place once written. A failed write (most often a full disk) removes the
//! temporary, so that no part-written file is left taking the space, and an earlier file of
//! that name stays as it was. `same_file` is the check before a write that an output is no
//! input.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Whether two paths name one file, whether or not it exists yet: their folders resolved
/// (links and `..` followed) and their names compared.
pub fn same_file(a: &Path, b: &Path) -> bool {
    let resolve = |p: &Path| {
        let folder = match p.parent() {
            Some(f) if !f.as_os_str().is_empty() => f,
            _ => Path::new("."),
        };
        (
            folder.canonicalize().ok(),
            p.file_name().map(|n| n.to_owned()),
        )
    };
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => {
            let (x, y) = (resolve(a), resolve(b));
            x.0.is_some() && x == y
        }
    }
}

/// The temporary that `path` is written through: `NAME.tmp` beside it.
pub fn temporary_for(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Runs `write` on the temporary for `path`, then renames it into place; on failure the
/// temporary is removed and the error returned.
pub fn write_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary_for(path);
    let done = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    });
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// Checks, before long work whose result goes to file `path`, that the file can be written
/// there: a folder in its place is refused, its folder is created, and the file is opened for
/// writing (and removed again where it did not exist). `what` names it in errors (a flag).
pub fn check_writable(path: &Path, what: &str) -> Result<()> {
    if path.is_dir() {
        anyhow::bail!(
            "{what} {}: a folder; name the file to write",
            path.display()
        );
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("{what} {}: cannot be written", path.display()))?;
    if !existed {
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(())
}

/// `bytes` as the whole of `path`.
pub fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |tmp| {
        std::fs::write(tmp, bytes).with_context(|| format!("writing {}", tmp.display()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_earlier_file_and_no_temporary() {
        let dir = std::env::temp_dir().join(format!("lorafit-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.bin");
        write(&path, b"first").unwrap();
        let e = write_with(&path, |tmp| {
            std::fs::write(tmp, b"part")?;
            anyhow::bail!("the disk filled up")
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "the disk filled up");
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert!(!temporary_for(&path).exists());
        write(&path, b"second").unwrap();
        // Checked before the work: a folder, a path through a file, a new file (not left).
        let e = check_writable(&dir, "--out").unwrap_err().to_string();
        assert!(e.contains("a folder; name the file to write"), "{e}");
        assert!(check_writable(&path.join("x.json"), "--out").is_err());
        let new = dir.join("sub/new.json");
        check_writable(&new, "--out").unwrap();
        assert!(!new.exists() && dir.join("sub").is_dir());
        check_writable(&path, "--out").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
