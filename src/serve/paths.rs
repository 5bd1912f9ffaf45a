//! Keeps a job's files inside the folders the server was started with (`--root`). Every path a
//! job names (model, data, validation data, warm start, output) is resolved against the first
//! root when relative, must not contain `..`, and is canonicalised (symlinks followed) before it
//! is compared with the canonical roots, so neither `..` nor a symlink leads out. An output
//! folder that does not exist yet is checked through its nearest existing ancestor.

use std::path::{Component, Path, PathBuf};

/// Why a path was refused: the setting it came from and what is wrong.
#[derive(Debug)]
pub struct PathRefused {
    pub field: &'static str,
    pub message: String,
    /// true: the path leads outside the roots (403); false: it is unusable (400).
    pub forbidden: bool,
}

impl std::fmt::Display for PathRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// The canonical roots.
#[derive(Clone, Debug)]
pub struct Roots(Vec<PathBuf>);

impl Roots {
    pub fn new(dirs: &[PathBuf]) -> anyhow::Result<Roots> {
        let mut roots = Vec::new();
        for d in dirs {
            let c = d.canonicalize().map_err(|e| {
                anyhow::anyhow!(
                    "--root {}: {e} (a root must be an existing folder)",
                    d.display()
                )
            })?;
            if !c.is_dir() {
                anyhow::bail!("--root {}: not a folder", d.display());
            }
            roots.push(c);
        }
        if roots.is_empty() {
            anyhow::bail!("no --root folder");
        }
        Ok(Roots(roots))
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.0
    }

    fn inside(&self, p: &Path) -> bool {
        self.0.iter().any(|r| p.starts_with(r))
    }

    fn absolute(&self, field: &'static str, given: &str) -> Result<PathBuf, PathRefused> {
        if given.trim().is_empty() {
            return Err(PathRefused {
                field,
                message: "empty path".into(),
                forbidden: false,
            });
        }
        let p = Path::new(given);
        if p.components().any(|c| c == Component::ParentDir) {
            return Err(PathRefused {
                field,
                message: format!("{given:?} contains `..`; name the path inside a root directly"),
                forbidden: true,
            });
        }
        Ok(if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.0[0].join(p)
        })
    }

    fn outside(&self, field: &'static str, given: &str, resolved: &Path) -> PathRefused {
        PathRefused {
            field,
            message: format!(
                "{given:?} resolves to {} which is outside the server's roots ({})",
                resolved.display(),
                self.0
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            forbidden: true,
        }
    }

    /// [`Roots::existing`] in place: `given` becomes its canonical path inside a root.
    pub fn confine(&self, field: &'static str, given: &mut String) -> Result<(), PathRefused> {
        *given = self.existing(field, given)?.display().to_string();
        Ok(())
    }

    /// [`Roots::confine`] for a setting that may be unset.
    pub fn confine_opt(
        &self,
        field: &'static str,
        given: &mut Option<String>,
    ) -> Result<(), PathRefused> {
        match given {
            Some(g) => self.confine(field, g),
            None => Ok(()),
        }
    }

    /// An existing file or folder inside a root, canonical.
    pub fn existing(&self, field: &'static str, given: &str) -> Result<PathBuf, PathRefused> {
        let abs = self.absolute(field, given)?;
        let canonical = abs.canonicalize().map_err(|e| PathRefused {
            field,
            message: format!("{given:?}: {e}"),
            forbidden: false,
        })?;
        if !self.inside(&canonical) {
            return Err(self.outside(field, given, &canonical));
        }
        Ok(canonical)
    }

    /// A folder to write into, which may not exist yet: its nearest existing ancestor is
    /// canonicalised and must be inside a root; the rest is appended as given.
    pub fn writable(&self, field: &'static str, given: &str) -> Result<PathBuf, PathRefused> {
        let abs = self.absolute(field, given)?;
        let mut existing = abs.as_path();
        let mut tail = Vec::new();
        while !existing.exists() {
            // `exists` follows symlinks: a dangling link is not "missing", it is refused below.
            if existing.symlink_metadata().is_ok() {
                return Err(PathRefused {
                    field,
                    message: format!("{} is a dangling symlink", existing.display()),
                    forbidden: true,
                });
            }
            match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    tail.push(name.to_os_string());
                    existing = parent;
                }
                _ => break,
            }
        }
        let mut canonical = existing.canonicalize().map_err(|e| PathRefused {
            field,
            message: format!("{}: {e}", existing.display()),
            forbidden: false,
        })?;
        for name in tail.iter().rev() {
            canonical.push(name);
        }
        if !self.inside(&canonical) {
            return Err(self.outside(field, given, &canonical));
        }
        if canonical.is_file() {
            return Err(PathRefused {
                field,
                message: format!("{} is a file; name a folder", canonical.display()),
                forbidden: false,
            });
        }
        Ok(canonical)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_by_dotdot_absolute_path_and_symlink_are_refused() {
        let base = std::env::temp_dir().join(format!("lorafit-roots-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("root");
        let outside = base.join("outside");
        std::fs::create_dir_all(root.join("data")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("data/train.jsonl"), "{}").unwrap();
        std::fs::write(outside.join("secret.jsonl"), "{}").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let roots = Roots::new(std::slice::from_ref(&root)).unwrap();
        let root_c = root.canonicalize().unwrap();

        assert_eq!(
            roots.existing("data", "data/train.jsonl").unwrap(),
            root_c.join("data/train.jsonl")
        );
        let e = roots
            .existing("data", "data/../../outside/secret.jsonl")
            .unwrap_err();
        assert!(
            e.forbidden && e.field == "data" && e.message.contains(".."),
            "{e}"
        );
        let e = roots
            .existing("data", outside.join("secret.jsonl").to_str().unwrap())
            .unwrap_err();
        assert!(e.forbidden && e.message.contains("outside"), "{e}");
        let e = roots.existing("data", "link/secret.jsonl").unwrap_err();
        assert!(e.forbidden, "{e}");
        let e = roots.existing("data", "data/missing.jsonl").unwrap_err();
        assert!(!e.forbidden, "{e}");

        assert_eq!(
            roots.writable("output", "runs/a/b").unwrap(),
            root_c.join("runs/a/b")
        );
        let e = roots.writable("output", "link/new-run").unwrap_err();
        assert!(e.forbidden && e.field == "output", "{e}");
        let e = roots.writable("output", "/").unwrap_err();
        assert!(e.forbidden, "{e}");
        let e = roots.writable("output", "data/train.jsonl").unwrap_err();
        assert!(!e.forbidden && e.message.contains("a file"), "{e}");
        std::os::unix::fs::symlink(base.join("nowhere"), root.join("dangling")).unwrap();
        let e = roots.writable("output", "dangling/run").unwrap_err();
        assert!(e.forbidden && e.message.contains("dangling"), "{e}");
    }
}
