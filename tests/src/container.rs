//! Containers for the end-to-end tests: root's podman (as
//! scripts/container-tools.sh sets it up) driven through its command line,
//! the runtime image of deploy/docker/Dockerfile built around the release
//! binary, and guards that remove every container, network, pod and volume
//! they name when dropped (also when a test fails).
//!
//! A module of tests/tests/container.rs (`#[path]`), not of the harness
//! library: only that binary needs it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_tests::binary;

/// The Dockerfile's RUNTIME_IMAGE here: no registry serves
/// debian:bookworm-slim to these machines, so scripts/container-tools.sh
/// makes it from debootstrap (same name there).
pub const BASE_IMAGE: &str = "localhost/debian:bookworm-slim";
/// The runtime image the tests build (`prebuilt` stage). One tag, rebuilt
/// by every run: a warm run rebuilds only the binary's layer.
pub const IMAGE: &str = "localhost/tandem:e2e";

/// Where scripts/container-tools.sh keeps its state: the base image's
/// tarball, and `unavailable` (why no engine runs here) when it found none.
pub fn state_dir() -> PathBuf {
    let cache = std::env::var_os("TANDEM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tandem")
        });
    cache.join("container")
}

/// Root's podman with this run's containers.conf (`CONTAINERS_CONF`).
#[derive(Debug)]
pub struct Podman {
    _dir: tempfile::TempDir,
    conf: PathBuf,
}

impl Podman {
    /// The engine, or why there is none here (the test then skips with
    /// that reason). Only scripts/container-tools.sh decides that there is
    /// none; a missing podman or base image without its verdict is a setup
    /// error, not a skip.
    pub fn get() -> Result<&'static Podman, String> {
        static ENGINE: OnceLock<Result<Podman, String>> = OnceLock::new();
        ENGINE
            .get_or_init(Self::probe)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn probe() -> Result<Podman, String> {
        let verdict = state_dir().join("unavailable");
        if let Ok(reason) = std::fs::read_to_string(&verdict) {
            return Err(format!(
                "scripts/container-tools.sh found no container engine here ({}): {}",
                verdict.display(),
                reason.trim()
            ));
        }
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("containers.conf");
        std::fs::write(&conf, containers_conf()).unwrap();
        let p = Podman { _dir: dir, conf };
        if let Err(e) = p.output(&["image", "exists", BASE_IMAGE]) {
            panic!(
                "podman or its base image {BASE_IMAGE} is missing ({e}): run \
                 scripts/container-tools.sh (it installs podman and makes the image)"
            );
        }
        Ok(p)
    }

    /// `podman ARGS` with this run's settings.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf).args(args);
        cmd
    }

    /// Stdout of `podman ARGS` (trimmed), or what went wrong.
    pub fn output(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .command(args)
            .output()
            .map_err(|e| format!("running podman: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(format!(
                "podman {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// [`Podman::output`] that must succeed.
    pub fn run(&self, args: &[&str]) -> String {
        self.output(args).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// runc (crun refuses these VMs' hybrid cgroup layout), and ulimits no
/// higher than this process's hard limits: podman's defaults are higher,
/// and the VM lets no process raise a limit. nproc is also capped at
/// pid_max (more processes cannot exist; a higher nproc is refused here).
fn containers_conf() -> String {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    let mut ulimits = Vec::new();
    if let Some(n) = hard_limit(&limits, "Max open files") {
        ulimits.push(format!("\"nofile={n}:{n}\""));
    }
    let nproc = match (hard_limit(&limits, "Max processes"), pid_max) {
        (Some(n), Some(m)) => Some(n.min(m)),
        (n, m) => n.or(m),
    };
    if let Some(n) = nproc {
        ulimits.push(format!("\"nproc={n}:{n}\""));
    }
    format!(
        "[containers]\ndefault_ulimits = [{}]\n\n[engine]\nruntime = \"runc\"\n",
        ulimits.join(", ")
    )
}

/// The hard limit on the `/proc/self/limits` line named `name` (None when
/// unlimited or absent).
fn hard_limit(limits: &str, name: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with(name))?;
    let mut fields = line[name.len()..].split_whitespace();
    let _soft = fields.next()?;
    fields.next()?.parse().ok()
}

/// A name no other run (or test of this run) uses: `tandem-e2e-WHAT-PID-T`.
pub fn unique(what: &str) -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
        % 1_000_000;
    format!("tandem-e2e-{what}-{}-{t}", std::process::id())
}

/// The runtime image as a test run built it.
#[derive(Debug, Clone)]
pub struct Image {
    pub id: String,
    /// `podman image inspect` .Size: every layer, the base included.
    pub size_bytes: u64,
    pub binary_bytes: u64,
    pub build_time: Duration,
}

/// [`IMAGE`], built once per process from the release binary: the
/// Dockerfile's `prebuilt` stage on [`BASE_IMAGE`], the context a
/// directory holding only the binary (debug info stripped, as the
/// Dockerfile's own build leaves it out). Runs that share the machine take
/// turns (a lock file); a warm run reuses every layer but the binary's.
/// The image this replaces is removed, so the store does not grow by a
/// binary per run.
pub fn runtime_image(p: &Podman) -> &'static Image {
    static IMAGE_BUILT: OnceLock<Image> = OnceLock::new();
    IMAGE_BUILT.get_or_init(|| {
        let dir = state_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let lock = File::create(dir.join("build.lock")).unwrap();
        lock.lock().unwrap();
        let image = build_image(p);
        drop(lock);
        image
    })
}

fn build_image(p: &Podman) -> Image {
    let start = Instant::now();
    let ctx = tempfile::tempdir().unwrap();
    let bin = ctx.path().join("tandem");
    let strip = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(binary())
        .arg(&bin)
        .status()
        .unwrap_or_else(|e| panic!("running objcopy (binutils): {e}"));
    assert!(strip.success(), "objcopy --strip-debug failed: {strip}");
    let dockerfile = tandem_tests::repo_root().join("deploy/docker/Dockerfile");
    let previous = p
        .output(&["image", "inspect", "--format", "{{.Id}}", IMAGE])
        .ok();
    p.run(&[
        "build",
        "--quiet",
        "--pull=never",
        "--runtime",
        "runc",
        "--layers",
        "-f",
        dockerfile.to_str().unwrap(),
        "--target",
        "prebuilt",
        "--build-arg",
        &format!("RUNTIME_IMAGE={BASE_IMAGE}"),
        "-t",
        IMAGE,
        ctx.path().to_str().unwrap(),
    ]);
    let id = p.run(&["image", "inspect", "--format", "{{.Id}}", IMAGE]);
    if let Some(old) = previous.filter(|old| *old != id) {
        // In use by a container of another run: it stays, harmlessly.
        let _ = p.output(&["rmi", &old]);
    }
    // The image's binary is the one these tests were built with.
    let version = p.run(&["run", "--rm", "--network", "none", IMAGE, "--version"]);
    let want = format!("(source {})", env!("TANDEM_SOURCE_HASH"));
    assert!(
        version.contains(&want),
        "{IMAGE} runs {version:?}, not {want}"
    );
    let size_bytes = p
        .run(&["image", "inspect", "--format", "{{.Size}}", IMAGE])
        .parse()
        .unwrap();
    Image {
        id,
        size_bytes,
        binary_bytes: std::fs::metadata(&bin).unwrap().len(),
        build_time: start.elapsed(),
    }
}

/// What a guard removes when dropped.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Container,
    Network,
    Pod,
    Volume,
    Image,
}

/// A podman object this test created (or is about to): removed on drop,
/// with whatever runs in it, also when the test panics.
#[derive(Debug)]
pub struct Owned {
    pub name: String,
    kind: Kind,
    podman: &'static Podman,
}

impl Drop for Owned {
    fn drop(&mut self) {
        let n = self.name.as_str();
        let args: &[&str] = match self.kind {
            // --volumes: kube play's emptyDir volumes are the container's
            // anonymous volumes.
            Kind::Container => &["rm", "--force", "--volumes", "--time", "0", n],
            Kind::Network => &["network", "rm", "--force", n],
            Kind::Pod => &["pod", "rm", "--force", n],
            Kind::Volume => &["volume", "rm", "--force", n],
            Kind::Image => &["rmi", "--force", n],
        };
        let _ = self.podman.output(args);
    }
}

/// A network of its own (netavark's bridge with DNS: containers reach each
/// other by name).
pub fn network(p: &'static Podman, name: &str) -> Owned {
    let owned = Owned {
        name: name.to_string(),
        kind: Kind::Network,
        podman: p,
    };
    p.run(&["network", "create", name]);
    owned
}

/// A named volume holding a copy of `file`.
pub fn volume_with(p: &'static Podman, name: &str, file: &Path) -> Owned {
    let owned = Owned {
        name: name.to_string(),
        kind: Kind::Volume,
        podman: p,
    };
    p.run(&["volume", "create", name]);
    let dir = p.run(&["volume", "inspect", "--format", "{{.Mountpoint}}", name]);
    std::fs::copy(file, Path::new(&dir).join(file.file_name().unwrap())).unwrap();
    owned
}

/// An image this test builds under `name` (removed on drop).
pub fn image(p: &'static Podman, name: &str) -> Owned {
    Owned {
        name: name.to_string(),
        kind: Kind::Image,
        podman: p,
    }
}

/// A pod that `podman kube play` creates under this name.
pub fn pod(p: &'static Podman, name: &str) -> Owned {
    Owned {
        name: name.to_string(),
        kind: Kind::Pod,
        podman: p,
    }
}

/// A running container.
#[derive(Debug)]
pub struct Container {
    owned: Owned,
}

impl Container {
    /// `podman run -d --name NAME ARGS` (ARGS: options, image, command).
    pub fn run(p: &'static Podman, name: &str, args: &[&str]) -> Container {
        let c = Container::adopt(p, name);
        let mut all = vec!["run", "--detach", "--name", name];
        all.extend_from_slice(args);
        p.run(&all);
        c
    }

    /// `podman create --name NAME IMAGE` (not started).
    pub fn create(p: &'static Podman, name: &str, image: &str) -> Container {
        let c = Container::adopt(p, name);
        p.run(&["create", "--name", name, image]);
        c
    }

    /// A container something else creates under `name` (kube play).
    pub fn adopt(p: &'static Podman, name: &str) -> Container {
        Container {
            owned: Owned {
                name: name.to_string(),
                kind: Kind::Container,
                podman: p,
            },
        }
    }

    pub fn name(&self) -> &str {
        &self.owned.name
    }

    fn podman(&self) -> &'static Podman {
        self.owned.podman
    }

    /// The host port that `container_port` is published on (127.0.0.1).
    pub fn port(&self, container_port: u16) -> u16 {
        let spec = format!("{container_port}/tcp");
        let out = self.podman().run(&["port", self.name(), &spec]);
        out.lines()
            .next()
            .and_then(|l| l.rsplit(':').next())
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("{}: {spec} is not published: {out:?}", self.name()))
    }

    /// `podman inspect --format FORMAT`.
    pub fn inspect(&self, format: &str) -> String {
        self.podman()
            .run(&["inspect", "--format", format, self.name()])
    }

    pub fn is_running(&self) -> bool {
        self.podman()
            .output(&["inspect", "--format", "{{.State.Running}}", self.name()])
            .is_ok_and(|s| s == "true")
    }

    /// Its output so far (stdout and stderr).
    pub fn logs(&self) -> String {
        let out = self.podman().command(&["logs", self.name()]).output();
        match out {
            Ok(o) => format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => format!("(no logs: {e})"),
        }
    }

    /// `podman exec [OPTIONS] NAME COMMAND...`: stdout, or the failure.
    pub fn exec(&self, options: &[&str], command: &[&str]) -> Result<String, String> {
        let mut all = vec!["exec"];
        all.extend_from_slice(options);
        all.push(self.name());
        all.extend_from_slice(command);
        self.podman().output(&all)
    }
}

/// Polls `ready` until it holds; panics at the deadline, or as soon as one
/// of `watched` stops running, with their logs.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    watched: &[&Container],
    mut ready: impl FnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if ready() {
            return start.elapsed();
        }
        let stopped = watched.iter().find(|c| !c.is_running());
        if stopped.is_some() || start.elapsed() > timeout {
            let logs: Vec<String> = watched
                .iter()
                .map(|c| format!("--- {} ---\n{}", c.name(), c.logs()))
                .collect();
            panic!(
                "{what}: {} after {:?}\n{}",
                stopped.map_or("timed out".to_string(), |c| format!("{} exited", c.name())),
                start.elapsed(),
                logs.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
