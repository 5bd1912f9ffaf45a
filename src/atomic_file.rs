//! Files written whole or not at all: the bytes go to a temporary beside the file, which is
//! renamed into place once written. A failed write (most often a full disk) removes the
//! temporary, so that no part-written file is left taking the space, and an earlier file of
//! that name stays as it was.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

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
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
