//! Kernel compilation: CUDA C sources (the `.cu` files beside this) compiled by NVRTC for the
//! device's architecture when the backend opens the GPU (every module the cache lacks, in
//! parallel: `prepare_modules`), cached on disk by a hash of source, architecture, options and
//! NVRTC version. Needs no GPU, only libnvrtc, so tests on a GPU-less machine can compile every
//! kernel.

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const COMMON: &str = include_str!("kernels/common.cuh");

const ATTENTION: &str = include_str!("kernels/attention.cu");

/// The kernel modules: (name, source without the common prelude). attention.cu is three modules,
/// each compiling one part of its kernels (`attention_part`), because it alone took most of the
/// compile time: as parts, the modules compile in parallel in about half of it.
pub const MODULES: &[(&str, &str)] = &[
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("attention_v1", ATTENTION),
    ("attention_v234", ATTENTION),
    ("attention_v567", ATTENTION),
    ("dequant", include_str!("kernels/dequant.cu")),
    ("cce", include_str!("kernels/cce.cu")),
    ("objective", include_str!("kernels/objective.cu")),
    ("decode", include_str!("kernels/decode.cu")),
    ("mlp_grads", include_str!("kernels/mlp_grads.cu")),
];

/// The part of attention.cu (its `LF_ATTN_PART`) that module `name` compiles, for the attention
/// modules: 1, version 1 and the small kernels the others share; 2, versions 2 to 4; 3, versions
/// 5 to 7.
pub fn attention_part(name: &str) -> Option<u32> {
    match name {
        "attention_v1" => Some(1),
        "attention_v234" => Some(2),
        "attention_v567" => Some(3),
        _ => None,
    }
}

/// The kernel module (`MODULES`) that holds kernel `func`, by its name's prefix; attention's by
/// version (`attention_part`): lf_attn2_… to lf_attn4_…, lf_attn5_… to lf_attn7_…, and version 1
/// with the shared kernels (lf_attn_…).
pub fn module_of(func: &str) -> &'static str {
    if let Some(rest) = func.strip_prefix("lf_attn") {
        match rest.as_bytes().first() {
            Some(b'2'..=b'4') => "attention_v234",
            Some(b'5'..=b'7') => "attention_v567",
            _ => "attention_v1",
        }
    } else if func.starts_with("lf_cce") {
        "cce"
    } else if func.starts_with("lf_deq") {
        "dequant"
    } else if func.starts_with("lf_obj") {
        "objective"
    } else if func.starts_with("lf_dec_") {
        "decode"
    } else if func.starts_with("lf_mlpg_") {
        "mlp_grads"
    } else {
        "elementwise"
    }
}

/// The architecture a module is compiled for on a device of `arch`: the attention modules take
/// Hopper's architecture-specific target (`sm_90a`, which has wgmma) on sm_90 devices; the wgmma
/// kernels compile to empty bodies elsewhere and are never chosen there.
pub fn module_arch(name: &str, arch: &str) -> String {
    if attention_part(name).is_some() && arch == "sm_90" {
        "sm_90a".into()
    } else {
        arch.into()
    }
}

/// Full source of a module: the shared prelude, then the module (an attention module's part
/// selected before it).
pub fn module_source(name: &str) -> Result<String> {
    let (_, body) = MODULES
        .iter()
        .find(|(n, _)| *n == name)
        .ok_or_else(|| anyhow!("no kernel module {name:?}"))?;
    Ok(match attention_part(name) {
        Some(part) => format!("{COMMON}\n#define LF_ATTN_PART {part}\n{body}"),
        None => format!("{COMMON}\n{body}"),
    })
}

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
}

/// Candidate folders of the CUDA toolkit's libraries and headers: `CUDA_HOME`/`CUDA_PATH`,
/// /usr/local/cuda, and the pip wheels' `site-packages/nvidia/cu13`.
fn toolkit_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            roots.push(PathBuf::from(v));
        }
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    if let Some(p) = python_nvidia_dir() {
        roots.push(p.join("cu13"));
    }
    roots
}

fn python_nvidia_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = std::process::Command::new("python3")
            .args(["-c", "import nvidia, os; print(list(nvidia.__path__)[0])"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        let s = String::from_utf8(out.stdout).ok()?;
        let p = PathBuf::from(s.trim());
        p.is_dir().then_some(p)
    })
    .clone()
}

/// The include folder that holds `cuda_bf16.h`.
pub fn include_dir() -> Option<PathBuf> {
    if let Ok(v) = std::env::var("LORAFIT_CUDA_INCLUDE") {
        return Some(PathBuf::from(v));
    }
    toolkit_roots()
        .into_iter()
        .map(|r| r.join("include"))
        .find(|d| d.join("cuda_bf16.h").is_file())
}

/// Makes libnvrtc loadable: if it is not on the loader's path, dlopen it by full path from
/// `LORAFIT_NVRTC_LIB` or a toolkit folder, so cudarc's later lookup by soname finds it loaded.
pub fn ensure_nvrtc() -> Result<()> {
    static OK: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    OK.get_or_init(|| {
        // SAFETY: probing only opens (and drops) the library.
        if unsafe { nvrtc_sys::is_culib_present() } {
            return Ok(());
        }
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Ok(v) = std::env::var("LORAFIT_NVRTC_LIB") {
            candidates.push(PathBuf::from(v));
        }
        for r in toolkit_roots() {
            for sub in ["lib64", "lib"] {
                candidates.push(r.join(sub).join("libnvrtc.so.13"));
            }
        }
        for c in &candidates {
            if !c.is_file() {
                continue;
            }
            let Ok(cs) = CString::new(c.to_string_lossy().as_bytes()) else {
                continue;
            };
            // NVRTC dlopens its builtins library by soname at compile time: load it first from
            // the same folder so that lookup finds it.
            if let Some(dir) = c.parent() {
                if let Ok(entries) = std::fs::read_dir(dir) {
                    for e in entries.flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        if name.starts_with("libnvrtc-builtins.so") {
                            if let Ok(bs) = CString::new(e.path().to_string_lossy().as_bytes()) {
                                // SAFETY: as below.
                                unsafe { dlopen(bs.as_ptr(), 0x102) };
                            }
                        }
                    }
                }
            }
            // SAFETY: dlopen with a valid NUL-terminated path; the handle is leaked on purpose
            // so the library stays loaded for the process.
            let h = unsafe { dlopen(cs.as_ptr(), 0x102 /* RTLD_NOW | RTLD_GLOBAL */) };
            // SAFETY: as above, a probe.
            if !h.is_null() && unsafe { nvrtc_sys::is_culib_present() } {
                return Ok(());
            }
        }
        Err(format!(
            "libnvrtc.so.13 not found (set LD_LIBRARY_PATH or LORAFIT_NVRTC_LIB); looked in {candidates:?}"
        ))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

pub fn nvrtc_version() -> Result<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((a, b))
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The on-disk kernel cache: `$LORAFIT_CACHE/kernels`, else `~/.cache/lorafit/kernels`.
fn cache_dir() -> Option<PathBuf> {
    if let Ok(v) = std::env::var("LORAFIT_CACHE") {
        return Some(PathBuf::from(v).join("kernels"));
    }
    std::env::var("HOME")
        .ok()
        .map(|h| PathBuf::from(h).join(".cache/lorafit/kernels"))
}

/// Compiles `src` for `arch` (e.g. "sm_90"): a CUBIN when `cubin`, else PTX for the matching
/// virtual architecture. Results are cached on disk (`cache_dir`).
pub fn compile(name: &str, src: &str, arch: &str, cubin: bool) -> Result<Vec<u8>> {
    compile_in(name, src, arch, cubin, cache_dir().as_deref())
}

/// [`compile`] with the cache in `cache` (None: no cache).
pub fn compile_in(
    name: &str,
    src: &str,
    arch: &str,
    cubin: bool,
    cache: Option<&Path>,
) -> Result<Vec<u8>> {
    let job = Job::new(name, src, arch, cubin, cache)?;
    if let Some(p) = job.path.as_ref().filter(|_| !job.verbose) {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let bytes = compile_uncached(name, src, &job.opts, cubin)?;
    if let Some(p) = &job.path {
        // Best effort: a read-only home just means no cache.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("{}.tmp{}", job.ext, std::process::id()));
        if std::fs::write(&tmp, &bytes).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(bytes)
}

/// One compilation's NVRTC options and the cache file it lands in.
struct Job {
    opts: Vec<String>,
    ext: &'static str,
    path: Option<PathBuf>,
    /// `LORAFIT_PTXAS_VERBOSE`: always compiles, to print ptxas's report.
    verbose: bool,
}

impl Job {
    fn new(name: &str, src: &str, arch: &str, cubin: bool, cache: Option<&Path>) -> Result<Job> {
        ensure_nvrtc()?;
        let inc = include_dir().ok_or_else(|| {
            anyhow!("cuda_bf16.h not found: set CUDA_HOME or LORAFIT_CUDA_INCLUDE")
        })?;
        let gpu_arch = if cubin {
            arch.to_string()
        } else {
            arch.replace("sm_", "compute_")
        };
        let mut opts = vec![
            format!("--gpu-architecture={gpu_arch}"),
            format!("--include-path={}", inc.display()),
            "--std=c++17".to_string(),
            "--fmad=true".to_string(),
            "-default-device".to_string(),
        ];
        // LORAFIT_PTXAS_VERBOSE=1 prints registers, spills and shared memory per kernel.
        let verbose = std::env::var_os("LORAFIT_PTXAS_VERBOSE").is_some();
        if verbose {
            opts.push("--ptxas-options=-v".into());
        }
        let (maj, min) = nvrtc_version()?;
        let ver = format!("{maj}.{min}");
        // The include path is left out of the key: the headers are the toolkit's, whose version
        // the NVRTC version already names, so a cache built on one machine serves another.
        let key_opts: Vec<&str> = opts
            .iter()
            .filter(|o| !o.starts_with("--include-path"))
            .map(|s| s.as_str())
            .collect();
        let key = fnv1a(&[
            src.as_bytes(),
            key_opts.join(" ").as_bytes(),
            ver.as_bytes(),
            if cubin { b"cubin" } else { b"ptx" },
        ]);
        let ext = if cubin { "cubin" } else { "ptx" };
        let path = cache.map(|d| d.join(format!("{name}-{gpu_arch}-{key:016x}.{ext}")));
        Ok(Job {
            opts,
            ext,
            path,
            verbose,
        })
    }

    /// Whether the cache holds this compilation's output (never with `verbose`).
    fn cached(&self) -> bool {
        !self.verbose
            && self
                .path
                .as_ref()
                .and_then(|p| std::fs::metadata(p).ok())
                .is_some_and(|m| m.len() > 0)
    }
}

/// Compiles every kernel module for a device of `arch` that the on-disk cache does not hold yet,
/// all at once on as many threads, and says so on stderr: on a machine that has not run this
/// build, the modules would otherwise compile one by one, silently, inside the first step (77 s
/// on the H200's machine). Returns how many modules it compiled; with no cache folder, none (each
/// module then compiles when first used, as before).
pub fn prepare_modules(arch: &str) -> Result<usize> {
    match cache_dir() {
        Some(dir) => prepare_modules_in(arch, &dir),
        None => Ok(0),
    }
}

/// [`prepare_modules`] with the cache in `dir`.
pub fn prepare_modules_in(arch: &str, dir: &Path) -> Result<usize> {
    let mut missing = Vec::new();
    for (name, _) in MODULES {
        let src = module_source(name)?;
        let arch = module_arch(name, arch);
        if !Job::new(name, &src, &arch, true, Some(dir))?.cached() {
            missing.push((*name, src, arch));
        }
    }
    if missing.is_empty() {
        return Ok(0);
    }
    let names: Vec<&str> = missing.iter().map(|m| m.0).collect();
    eprintln!(
        "compiling CUDA kernels for {arch} ({}), once per build and machine; cached in {}",
        names.join(", "),
        dir.display()
    );
    let start = std::time::Instant::now();
    std::thread::scope(|scope| {
        let threads: Vec<_> = missing
            .iter()
            .map(|(name, src, arch)| {
                scope.spawn(move || compile_in(name, src, arch, true, Some(dir)))
            })
            .collect();
        for (t, name) in threads.into_iter().zip(&names) {
            t.join()
                .map_err(|_| anyhow!("compiling kernel module {name}: the thread panicked"))?
                .with_context(|| format!("compiling kernel module {name}"))?;
        }
        Ok::<(), anyhow::Error>(())
    })?;
    eprintln!(
        "CUDA kernels compiled in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    Ok(missing.len())
}

fn compile_uncached(name: &str, src: &str, opts: &[String], cubin: bool) -> Result<Vec<u8>> {
    let csrc = CString::new(src).context("kernel source has a NUL byte")?;
    let cname = CString::new(format!("{name}.cu"))?;
    let prog = nvrtc::create_program(&csrc, Some(&cname))
        .map_err(|e| anyhow!("nvrtcCreateProgram({name}): {e:?}"))?;
    // SAFETY: `prog` is a live program until destroy_program below.
    let res = unsafe { nvrtc::compile_program(prog, opts) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    if let Err(e) = res {
        // SAFETY: as above.
        let _ = unsafe { nvrtc::destroy_program(prog) };
        bail!("NVRTC failed to compile kernel module {name}: {e:?}\n{log}");
    }
    if std::env::var_os("LORAFIT_PTXAS_VERBOSE").is_some() {
        eprintln!("{log}");
    }
    let out = if cubin {
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; `buf` has `size` bytes.
        unsafe {
            nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut buf = vec![0u8; size];
            nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                .result()
                .map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))?;
            buf
        }
    } else {
        // SAFETY: `prog` compiled successfully.
        let ptx = unsafe { nvrtc::get_ptx(prog) }.map_err(|e| anyhow!("nvrtcGetPTX: {e:?}"))?;
        let mut bytes: Vec<u8> = ptx.into_iter().map(|c| c as u8).collect();
        if bytes.last() != Some(&0) {
            bytes.push(0);
        }
        bytes
    };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel module compiles for sm_90 (CUBIN) where libnvrtc and the CUDA headers exist;
    /// skipped with a note otherwise. Needs no GPU. The cache is a fresh private folder, so the
    /// test really compiles (all modules at once, as `prepare_modules` does when a GPU opens);
    /// each module's CUBIN must land there and be served from there.
    #[test]
    fn kernels_compile_for_sm90() {
        if let Err(e) = ensure_nvrtc() {
            crate::skip_note("kernels_compile_for_sm90", &e.to_string());
            return;
        }
        if include_dir().is_none() {
            crate::skip_note("kernels_compile_for_sm90", "cuda_bf16.h not found");
            return;
        }
        let dir = std::env::temp_dir().join(format!("lorafit-kcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cached = |name: &str| -> Vec<PathBuf> {
            std::fs::read_dir(&dir)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.path())
                        .filter(|p| {
                            let f = p.file_name().unwrap().to_string_lossy().into_owned();
                            f.starts_with(&format!("{name}-sm_90")) && f.ends_with(".cubin")
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        // For kernel work, with LORAFIT_PTXAS_VERBOSE=1: LORAFIT_ONLY_MODULE=attention_v567
        // compiles one module, LORAFIT_KERNEL_SRC=file.cu takes that module's body from a file, and
        // LORAFIT_KERNEL_PTX=file.ptx writes its PTX there.
        let only = std::env::var("LORAFIT_ONLY_MODULE").ok();
        let body = std::env::var("LORAFIT_KERNEL_SRC").ok();
        let verbose = std::env::var_os("LORAFIT_PTXAS_VERBOSE").is_some();
        if only.is_none() && !verbose {
            // What a GPU does when it opens: every module compiled at once into the empty cache,
            // then nothing left to compile. The loop below is then served from the cache files
            // this wrote.
            let compiled = prepare_modules_in("sm_90", &dir).unwrap();
            assert_eq!(compiled, MODULES.len(), "modules compiled into {dir:?}");
            assert_eq!(
                prepare_modules_in("sm_90", &dir).unwrap(),
                0,
                "a second time"
            );
        }
        let mut found = std::collections::BTreeSet::new();
        for (name, _) in MODULES {
            if only.as_deref().is_some_and(|o| o != *name) {
                continue;
            }
            let src = match (&only, &body) {
                (Some(_), Some(f)) => format!("{COMMON}\n{}", std::fs::read_to_string(f).unwrap()),
                _ => module_source(name).unwrap(),
            };
            if let Ok(ptx_path) = std::env::var("LORAFIT_KERNEL_PTX") {
                let ptx =
                    compile_in(name, &src, &module_arch(name, "sm_90"), false, Some(&dir)).unwrap();
                std::fs::write(ptx_path, ptx).unwrap();
            }
            let arch = module_arch(name, "sm_90");
            let bin = compile_in(name, &src, &arch, true, Some(&dir))
                .unwrap_or_else(|e| panic!("module {name}: {e:#}"));
            assert!(bin.len() > 100, "module {name}: empty cubin");
            if body.is_none() {
                // Every kernel in the module's CUBIN is one the host looks for in this module.
                let kernels = kernel_names(&bin);
                assert!(!kernels.is_empty(), "module {name}: no lf_ kernels");
                for k in &kernels {
                    assert_eq!(
                        module_of(k),
                        *name,
                        "kernel {k} is compiled in module {name}"
                    );
                }
                found.extend(kernels);
            }
            let files = cached(name);
            assert_eq!(
                files.len(),
                1,
                "module {name}: cached CUBINs in {dir:?}: {files:?}"
            );
            assert_eq!(
                std::fs::read(&files[0]).unwrap(),
                bin,
                "module {name}: cache file"
            );
            // A second call is served from that folder: marked bytes come back (not with
            // LORAFIT_PTXAS_VERBOSE, which always compiles to print its report).
            if !verbose {
                std::fs::write(&files[0], b"cached").unwrap();
                let again = compile_in(name, &src, &arch, true, Some(&dir)).unwrap();
                assert_eq!(again, b"cached", "module {name}: not read from {dir:?}");
            }
        }
        if only.is_none() && body.is_none() {
            // One kernel of each attention version and of the shared ones, with and without the
            // softcap, and the MLP gradients' kernels, in the module the host loads each from
            // (checked above).
            for k in [
                "lf_attn_fwd_128",
                "lf_attn_bwd_dkdv_64_cap",
                "lf_attn_bwd_dot",
                "lf_attn_tile_flags",
                "lf_attn_dq_finish",
                "lf_attn_dkdv_reduce",
                "lf_attn2_fwd_256",
                "lf_attn3_fwd_128_cap",
                "lf_attn4_bwd_128",
                "lf_attn5_fwd_128",
                "lf_attn5_bwd_128_cap",
                "lf_attn6_bwd_256",
                "lf_attn7_dkdv_512_cap",
                "lf_mlpg_silu",
                "lf_mlpg_finish",
            ] {
                assert!(found.contains(k), "no module compiles {k}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The `lf_…` names in a CUBIN (its kernels, and the sections named after them).
    fn kernel_names(cubin: &[u8]) -> std::collections::BTreeSet<String> {
        let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let mut names = std::collections::BTreeSet::new();
        for i in 0..cubin.len().saturating_sub(3) {
            if &cubin[i..i + 3] == b"lf_" && (i == 0 || !ident(cubin[i - 1])) {
                let end = (i..cubin.len())
                    .find(|&j| !ident(cubin[j]))
                    .unwrap_or(cubin.len());
                names.insert(String::from_utf8_lossy(&cubin[i..end]).into_owned());
            }
        }
        names
    }

    /// Fills the on-disk kernel cache (`LORAFIT_CACHE`) for `LORAFIT_ARCH` (default sm_90), so a
    /// GPU machine can skip compilation: `--ignored warm_kernel_cache`.
    #[test]
    #[ignore]
    fn warm_kernel_cache() {
        let arch = std::env::var("LORAFIT_ARCH").unwrap_or_else(|_| "sm_90".into());
        prepare_modules(&arch).unwrap();
        eprintln!("kernel cache warmed in {:?}", cache_dir());
    }
}
