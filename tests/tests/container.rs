//! The image of deploy/docker/Dockerfile, built and run for real under
//! podman: its runtime stage around the release binary, `tandem serve` in
//! it as the image's non-root user on a read-only root filesystem (the
//! chart's securityContext as podman flags), answered from the host and
//! stopped with SIGTERM; a 1P1D cluster of containers (etcd, prefill,
//! decode, router on one podman network) answering through the router
//! with the KV moved between containers over UCX; and the chart's rendered
//! `serve` Deployment run by `podman kube play`. The Rust builder stage
//! cannot run here (no registry), but its context is checked.
//!
//! The model is mounted read-only, never copied into the image: the image
//! stays the one that ships (the chart mounts its model cache too), and a
//! warm run rebuilds only the binary's layer instead of re-adding 100 MB.
//!
//! Needs podman and its base image (scripts/container-tools.sh; where it
//! found no engine it says why, and these tests skip with that reason), the
//! release binary, `TANDEM_TEST_GGUF`, etcd on PATH and helm
//! (scripts/deploy-tools.sh).

#![allow(clippy::unwrap_used)]

#[path = "../src/container.rs"]
mod container;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use container::{
    BASE_IMAGE, Container, IMAGE, Image, Podman, image, network, pod, runtime_image, unique,
    volume_with, wait_until, which,
};
use serde_json::{Value, json};
use tandem_modelfile::chat::ChatMessage;
use tandem_tests::cluster::{expected, long_prompt};
use tandem_tests::{client_builder, gguf_path, http, metric, model, reference, repo_root};

/// Where the tests mount the model in every container.
const MODEL: &str = "/models/model.gguf";
/// A model load plus a few seconds, on 2 busy cores.
const STARTUP: Duration = Duration::from_secs(120);
const MAX_TOKENS: usize = 16;

/// The chart's securityContext as podman flags: a read-only root
/// filesystem with an empty /tmp (the chart's `tmp` emptyDir), no
/// capabilities, no privilege escalation. The user is the image's own.
const HARDENED: &[&str] = &[
    "--read-only",
    "--read-only-tmpfs=false",
    "--tmpfs",
    "/tmp",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
];

/// The engine, or `None` once it has said why these tests are skipped.
fn engine() -> Option<&'static Podman> {
    match Podman::get() {
        Ok(p) => Some(p),
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

/// `--volume` of the test model, read-only, at [`MODEL`].
fn model_volume() -> String {
    format!("{}:{MODEL}:ro", gguf_path().display())
}

fn chart_values() -> Value {
    let path = repo_root().join("deploy/helm/tandem/values.yaml");
    serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// What the chart gives the `serve` binary between SIGTERM and SIGKILL:
/// the pod's grace period less the preStop sleep that comes first.
fn serve_grace() -> Duration {
    let v = &chart_values()["serve"];
    let secs = |k: &str| {
        v[k].as_u64()
            .unwrap_or_else(|| panic!("serve.{k} in values.yaml"))
    };
    Duration::from_secs(secs("terminationGracePeriodSeconds") - secs("preStopSleepSeconds"))
}

/// The image's size as the chart's README states it: the number in
/// "image size: N MB".
fn readme_image_mb() -> f64 {
    let readme = std::fs::read_to_string(repo_root().join("deploy/helm/tandem/README.md")).unwrap();
    let flat = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let at = flat
        .find("image size: ")
        .expect("the chart README states the measured \"image size: N MB\"");
    let rest = &flat[at + "image size: ".len()..];
    rest.split(' ').next().unwrap().parse().unwrap()
}

/// Prints what the build measured, and holds the chart README to it.
fn check_image(image: &Image) {
    let mb = |b: u64| b as f64 / 1e6;
    eprintln!(
        "container image {IMAGE} ({}): {:.0} MB, of which the binary {:.0} MB; built in {:.1} s",
        &image.id[..12],
        mb(image.size_bytes),
        mb(image.binary_bytes),
        image.build_time.as_secs_f64()
    );
    let stated = readme_image_mb();
    let measured = mb(image.size_bytes);
    assert!(
        (measured - stated).abs() <= 0.15 * stated,
        "deploy/helm/tandem/README.md says image size: {stated} MB, the image measures {measured:.0} MB: update the README"
    );
}

/// GET `url`'s status, or None while nothing answers.
fn status_of(url: &str) -> Option<u16> {
    let client = client_builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    client.get(url).send().ok().map(|r| r.status().as_u16())
}

fn chat_body() -> (Value, String) {
    let question = "What is the capital of France?";
    let m = model();
    let rendered = m
        .text
        .chat_template
        .as_ref()
        .unwrap()
        .render(&[ChatMessage::new("user", question)], true)
        .unwrap();
    let want = reference(
        m.text.tokenizer.encode(&rendered, false).unwrap(),
        MAX_TOKENS,
    );
    let body = json!({
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    });
    (body, want)
}

/// A greedy chat completion at `base` (`http://host:port`) equals the
/// engine's greedy reference.
fn assert_chat_matches_reference(base: &str) {
    let (body, want) = chat_body();
    let r = client_builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        want.as_str(),
        "in a container: {v}"
    );
}

/// PID 1 is tandem, running as the image's user 10001, which the image
/// itself sets (nothing here passes --user).
fn assert_non_root(c: &Container) {
    assert_eq!(c.inspect("{{.Config.User}}"), "10001:10001");
    let status = c.exec(&[], &["cat", "/proc/1/status"]).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_else(|| panic!("no {k} in {status}"))
    };
    assert_eq!(field("Name:"), ["tandem"], "{status}");
    assert_eq!(field("Uid:"), ["10001"; 4], "{status}");
    assert_eq!(field("Gid:"), ["10001"; 4], "{status}");
}

/// Writes fail with EROFS: in the cache directory, which user 10001 owns
/// (so only a read-only mount can refuse it), and as root in /etc. /tmp
/// takes a write, so the refusals are not `touch` failing for another
/// reason.
fn assert_read_only_root(c: &Container) {
    assert_eq!(
        c.exec(&[], &["stat", "-c", "%u", "/var/cache/tandem"]),
        Ok("10001".to_string())
    );
    c.exec(&[], &["touch", "/tmp/probe"])
        .expect("the /tmp tmpfs takes a write");
    for (options, path) in [
        (&[][..], "/var/cache/tandem/probe"),
        (&["--user", "0"][..], "/etc/probe"),
    ] {
        let err = c
            .exec(options, &["touch", path])
            .expect_err("a write to the root filesystem succeeded");
        assert!(err.contains("Read-only file system"), "{path}: {err}");
    }
}

/// Stops `c` as an orchestrator does: `podman STOP --time GRACE TARGET`
/// (`stop` the container, or `pod stop` its pod) sends the stop signal,
/// SIGTERM, and SIGKILL only once `grace` has passed, and keeps a restart
/// policy from starting it again. Exit status 0, in less than `grace`, with the drain
/// logged, is a SIGTERM handled. Returns how long it took.
fn assert_sigterm_exits_0(
    p: &Podman,
    c: &Container,
    (stop, target): (&[&str], &str),
    grace: Duration,
) -> Duration {
    assert_eq!(c.inspect("{{.Config.StopSignal}}"), "15", "SIGTERM");
    let secs = grace.as_secs().to_string();
    let mut args = stop.to_vec();
    args.extend(["--time", &secs, target]);
    let start = Instant::now();
    p.run(&args);
    let took = start.elapsed();
    let logs = c.logs();
    assert_eq!(c.inspect("{{.State.Running}}"), "false", "{logs}");
    assert_eq!(c.inspect("{{.State.ExitCode}}"), "0", "{logs}");
    assert!(took < grace, "{took:?} to stop:\n{logs}");
    assert!(logs.contains("shutting down"), "{logs}");
    took
}

#[test]
fn serve_in_the_image_non_root_read_only_answers_and_stops_on_sigterm() {
    let Some(p) = engine() else { return };
    let image = runtime_image(p);
    check_image(image);
    let volume = model_volume();
    let mut args = HARDENED.to_vec();
    args.extend([
        "--publish",
        "127.0.0.1::8000",
        "--volume",
        &volume,
        IMAGE,
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--model",
        MODEL,
        "--threads",
        "1",
    ]);
    let start = Instant::now();
    let c = Container::run(p, &unique("serve"), &args);
    let port = c.port(8000);
    let base = format!("http://127.0.0.1:{port}");
    wait_until(
        "serve in a container answers /health",
        STARTUP,
        &[&c],
        || status_of(&format!("{base}/health")) == Some(200),
    );
    let ready = start.elapsed();

    assert_non_root(&c);
    assert_read_only_root(&c);
    assert_chat_matches_reference(&base);
    let m = http(port, "GET", "/metrics", "").body;
    assert_eq!(
        metric(&m, "tandem_requests_total", r#"status="ok""#),
        1.0,
        "{m}"
    );

    let grace = serve_grace();
    let stopped = assert_sigterm_exits_0(p, &c, (&["stop"], c.name()), grace);
    eprintln!(
        "serve container: ready in {:.1} s; SIGTERM to exit 0 in {:.2} s (grace {grace:?})",
        ready.as_secs_f64(),
        stopped.as_secs_f64()
    );
}

/// etcd in the base image: Debian's etcd binary (from the host; it links
/// only libc), read-only, its data on a tmpfs.
fn start_etcd(p: &'static Podman, name: &str, net: &str) -> Container {
    let bin = which("etcd")
        .expect("etcd is not on PATH: install Debian's etcd-server (scripts/test.sh does)");
    let bin = std::fs::canonicalize(bin).unwrap();
    let mount = format!("{}:/usr/local/bin/etcd:ro", bin.display());
    let client_url = format!("http://{name}:2379");
    Container::run(
        p,
        name,
        &[
            "--network",
            net,
            "--read-only",
            "--tmpfs",
            "/data",
            "--volume",
            &mount,
            BASE_IMAGE,
            "etcd",
            "--name",
            "e",
            "--data-dir",
            "/data/etcd",
            "--listen-client-urls",
            "http://0.0.0.0:2379",
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-cluster",
            "e=http://127.0.0.1:2380",
        ],
    )
}

/// Whether etcd answers `GET /health` with health true at `name`:2379,
/// asked from inside its container (bash's /dev/tcp: the base image has no
/// HTTP client) through the network's DNS.
fn etcd_healthy(etcd: &Container, name: &str) -> bool {
    let script = format!(
        "exec 3<>/dev/tcp/{name}/2379 && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3"
    );
    etcd.exec(&[], &["bash", "-c", &script])
        .is_ok_and(|r| r.contains(r#""health":"true""#))
}

/// A prefill or decode node, advertising its container name (which the
/// network's DNS resolves) and with its /metrics published on the host.
fn start_node(p: &'static Podman, role: &str, cluster: &str, net: &str, etcd: &str) -> Container {
    let name = format!("{cluster}-{role}");
    let volume = model_volume();
    let mut args = HARDENED.to_vec();
    args.extend([
        "--network",
        net,
        "--publish",
        "127.0.0.1::9090",
        "--volume",
        &volume,
        IMAGE,
        role,
        "--host",
        "0.0.0.0",
        "--port",
        "50051",
        "--metrics-port",
        "9090",
        "--advertise-host",
        &name,
        "--id",
        &name,
        "--etcd",
        etcd,
        "--cluster",
        cluster,
        "--model",
        MODEL,
        "--threads",
        "1",
        "--ucx-tls",
        "tcp",
        "--max-length",
        "512",
        "--kv-cache-blocks",
        "512",
    ]);
    if role == "decode" {
        // The test prompt (~120 tokens) is prefilled remotely.
        args.extend(["--remote-prefill-min-tokens", "32"]);
    }
    Container::run(p, &name, &args)
}

fn start_router(p: &'static Podman, cluster: &str, net: &str, etcd: &str) -> Container {
    let volume = model_volume();
    let mut args = HARDENED.to_vec();
    args.extend([
        "--network",
        net,
        "--publish",
        "127.0.0.1::8000",
        "--volume",
        &volume,
        IMAGE,
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--etcd",
        etcd,
        "--cluster",
        cluster,
        "--model",
        MODEL,
        "--max-length",
        "512",
    ]);
    Container::run(p, &format!("{cluster}-router"), &args)
}

/// The router's /health body (200 or 503), None while it does not answer.
fn router_health(port: u16) -> Option<Value> {
    let r = client_builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
        .get(format!("http://127.0.0.1:{port}/health"))
        .send()
        .ok()?;
    serde_json::from_str(&r.text().ok()?).ok()
}

/// The prefill and decode workers a router's /health lists.
fn workers(health: &Value) -> (usize, usize) {
    let n = |k: &str| health[k].as_array().map_or(0, Vec::len);
    (n("prefill_workers"), n("decode_workers"))
}

#[test]
fn one_prefill_one_decode_cluster_of_containers_answers_through_the_router() {
    let Some(p) = engine() else { return };
    runtime_image(p);
    let cluster = unique("1p1d");
    let net = network(p, &cluster);
    let start = Instant::now();
    let etcd_name = format!("{cluster}-etcd");
    let etcd = start_etcd(p, &etcd_name, &net.name);
    let etcd_url = format!("http://{etcd_name}:2379");
    // One container at a time, each once the last is up: aardvark-dns
    // reloads whenever a container joins the network and may drop a
    // lookup meanwhile, which glibc retries only after 5 s, and a node
    // gives up when etcd does not answer its registration within 3 s
    // (Kubernetes would restart it; here it would fail the test).
    wait_until("etcd is healthy by name", STARTUP, &[&etcd], || {
        etcd_healthy(&etcd, &etcd_name)
    });
    let router = start_router(p, &cluster, &net.name, &etcd_url);
    let port = router.port(8000);
    wait_until("the router answers", STARTUP, &[&etcd, &router], || {
        router_health(port).is_some()
    });
    let prefill = start_node(p, "prefill", &cluster, &net.name, &etcd_url);
    wait_until(
        "the router sees 1P0D",
        STARTUP,
        &[&etcd, &router, &prefill],
        || router_health(port).is_some_and(|h| workers(&h) == (1, 0)),
    );
    let decode = start_node(p, "decode", &cluster, &net.name, &etcd_url);
    let all = [&etcd, &prefill, &decode, &router];
    wait_until("the router sees 1P1D, verified", STARTUP, &all, || {
        router_health(port).is_some_and(|h| workers(&h) == (1, 1) && h["probation_total"] == 0)
    });
    let ready = start.elapsed();

    let prompt = long_prompt(1);
    let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0});
    let r = http(port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["choices"][0]["text"],
        expected(&prompt, MAX_TOKENS).as_str()
    );

    // The prefill container computed the prompt and wrote its KV into the
    // decode container over UCX (TCP between the two); the decode node
    // only decoded.
    let dm = http(decode.port(9090), "GET", "/metrics", "").body;
    let pm = http(prefill.port(9090), "GET", "/metrics", "").body;
    let remote = |outcome: &str| {
        metric(
            &dm,
            "tandem_decode_prefills_total",
            &format!("outcome=\"{outcome}\""),
        )
    };
    assert_eq!(remote("remote"), 1.0, "{dm}");
    assert_eq!(remote("local") + remote("fallback"), 0.0, "{dm}");
    assert!(
        metric(
            &pm,
            "tandem_dkv_bytes_transferred_bytes_total",
            "connector=\"ucx\""
        ) > 0.0,
        "{pm}"
    );
    assert!(
        metric(&pm, "tandem_batch_size_count", "batch_type=\"CE\"") >= 1.0,
        "{pm}"
    );
    assert_eq!(
        metric(&pm, "tandem_batch_size_count", "batch_type=\"TG\""),
        0.0
    );
    eprintln!(
        "1P1D containers: all four up and routing {:.1} s after the first started",
        ready.as_secs_f64()
    );
}

// ------------------------------------------------------ the builder's context

/// The workspace members' package names, as `cargo metadata` reads the
/// workspace at `root` (fails if a member is missing).
fn workspace_packages(root: &Path) -> Vec<String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--offline",
            "--no-deps",
            "--format-version",
            "1",
        ])
        .current_dir(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo metadata in {}: {}",
        root.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut names: Vec<String> = v["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

/// What may stand at the top of the builder's context: the lock file, the
/// root manifest and the top directory of every workspace member.
fn workspace_top_entries(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .unwrap()
        .0;
    let mut allowed: Vec<String> = members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| m.split('/').next().unwrap().to_string())
        .collect();
    allowed.extend(["Cargo.toml".into(), "Cargo.lock".into()]);
    allowed
}

/// The files under `dir` (recursively) with their sizes; panics on a
/// `target` directory.
fn files_under(dir: &Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                assert_ne!(e.file_name(), "target", "a build directory: {:?}", e.path());
                stack.push(e.path());
            } else {
                files.push((e.path(), e.metadata().unwrap().len()));
            }
        }
    }
    files
}

/// The context the engine sends for the repository root (through
/// .dockerignore), as `COPY . /src` in a throwaway image lands it, copied
/// out into `into`.
fn copy_of_root_context(p: &'static Podman, into: &Path) {
    let containerfile = into.join("Containerfile");
    std::fs::write(&containerfile, format!("FROM {BASE_IMAGE}\nCOPY . /src\n")).unwrap();
    let name = unique("context");
    let tag = format!("localhost/{name}:latest");
    let _image = image(p, &tag);
    p.run(&[
        "build",
        "--quiet",
        "--pull=never",
        "--runtime",
        "runc",
        "-f",
        containerfile.to_str().unwrap(),
        "-t",
        &tag,
        repo_root().to_str().unwrap(),
    ]);
    let _holder = Container::create(p, &name, &tag);
    p.run(&[
        "cp",
        &format!("{name}:/src"),
        into.join("src").to_str().unwrap(),
    ]);
}

/// The Rust builder stage's `COPY . .`: the whole Cargo workspace (every
/// member and the lock file: cargo reads it as it reads the checkout), and
/// at its top nothing else, so an edit to a README or a script does not
/// rebuild the binary's layers; no build output, model or large file is
/// sent. The Rust image itself is not reachable here, so the builder stage
/// is not run.
#[test]
fn builder_context_is_the_cargo_workspace_only() {
    let Some(p) = engine() else { return };
    let scratch = tempfile::tempdir().unwrap();
    copy_of_root_context(p, scratch.path());
    let copy = scratch.path().join("src");
    let root = repo_root();
    assert_eq!(workspace_packages(&copy), workspace_packages(&root));

    let allowed = workspace_top_entries(&root);
    let top: Vec<String> = std::fs::read_dir(&copy)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut extra: Vec<&String> = top.iter().filter(|t| !allowed.contains(t)).collect();
    extra.sort();
    assert!(
        extra.is_empty(),
        "outside the workspace in the context: {extra:?}"
    );

    let files = files_under(&copy);
    let big: Vec<_> = files
        .iter()
        .filter(|(f, len)| f.extension().is_some_and(|e| e == "gguf") || *len > 5_000_000)
        .collect();
    assert!(
        big.is_empty(),
        "models or large files in the context: {big:?}"
    );
    let total: u64 = files.iter().map(|(_, len)| len).sum();
    eprintln!(
        "builder context: {} files, {:.1} MB",
        files.len(),
        total as f64 / 1e6
    );
}

// ------------------------------------------------------------- kube play

/// helm as scripts/deploy-tools.sh installs it (or `TANDEM_HELM`).
fn helm() -> std::path::PathBuf {
    let p = tandem_testkit::cached_path("TANDEM_HELM", "tools/bin/helm");
    assert!(
        p.is_file(),
        "helm is missing at {}: run scripts/deploy-tools.sh, which installs it",
        p.display()
    );
    p
}

/// The chart rendered for the example values file `values` with `set`.
fn render(release: &str, values: &str, set: &[String]) -> String {
    let root = repo_root();
    let mut cmd = Command::new(helm());
    cmd.args(["template", release])
        .arg(root.join("deploy/helm/tandem"))
        .args(["--namespace", "tandem", "-f"])
        .arg(root.join(format!("deploy/helm/values/{values}.yaml")));
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The `metadata.name` of every document of kind `kind`.
fn names_of_kind(yaml: &str, kind: &str) -> Vec<String> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(yaml)
        .filter_map(|d| Value::deserialize(d).ok())
        .filter(|d| d["kind"] == kind)
        .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

/// The chart in aggregated mode (one `serve` Deployment) as rendered, run
/// by `podman kube play`: the image is this run's, the model a path in the
/// cache volume, which is an existing claim (kube play makes a claim a
/// podman volume of that name). Podman 4.3 runs the Deployment's pod with
/// the chart's security context, env and volumes; it does not run the
/// probes (they need systemd), so the test polls /health itself.
#[test]
fn chart_serve_deployment_runs_under_kube_play() {
    let Some(p) = engine() else { return };
    runtime_image(p);
    let release = unique("kp");
    let gguf = gguf_path();
    let file = gguf.file_name().unwrap().to_str().unwrap();
    let claim = format!("{release}-model");
    let (repo, tag) = IMAGE.rsplit_once(':').unwrap();
    let yaml = render(
        &release,
        "aggregated",
        &[
            format!("image.repository={repo}"),
            format!("image.tag={tag}"),
            format!("model.name=/var/cache/tandem/{file}"),
            "model.cache.type=persistentVolumeClaim".into(),
            format!("model.cache.claimName={claim}"),
            "serve.threads=1".into(),
        ],
    );
    let deployments = names_of_kind(&yaml, "Deployment");
    assert_eq!(deployments, [format!("{release}-serve")]);
    let manifest = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(manifest.path(), &yaml).unwrap();

    let _volume = volume_with(p, &claim, &gguf);
    let net = network(p, &release);
    // kube play names a Deployment's pod NAME-pod-0 and its container
    // POD-CONTAINER; both go on drop, whatever happens below.
    let pod_name = format!("{}-pod-0", deployments[0]);
    let _pod = pod(p, &pod_name);
    let c = Container::adopt(p, &format!("{pod_name}-serve"));
    let start = Instant::now();
    p.run(&[
        "kube",
        "play",
        "--network",
        &net.name,
        manifest.path().to_str().unwrap(),
    ]);
    let ip = c.inspect(&format!(
        "{{{{(index .NetworkSettings.Networks \"{}\").IPAddress}}}}",
        net.name
    ));
    let base = format!("http://{ip}:8000");
    wait_until(
        "the chart's serve pod answers /health",
        STARTUP,
        &[&c],
        || status_of(&format!("{base}/health")) == Some(200),
    );
    let ready = start.elapsed();

    // The chart's securityContext, as podman applied it.
    assert_non_root(&c);
    assert_eq!(c.inspect("{{.HostConfig.ReadonlyRootfs}}"), "true");
    assert_eq!(c.inspect("{{.EffectiveCaps}}"), "[]");
    let err = c
        .exec(&["--user", "0"], &["touch", "/etc/probe"])
        .expect_err("a write to the root filesystem succeeded");
    assert!(err.contains("Read-only file system"), "{err}");
    assert_chat_matches_reference(&base);

    // The pod, as Kubernetes deletes one (its restart policy, Always,
    // would start a container stopped alone again).
    let stopped = assert_sigterm_exits_0(p, &c, (&["pod", "stop"], &pod_name), serve_grace());
    eprintln!(
        "kube play (chart, aggregated): ready in {:.1} s; SIGTERM to exit 0 in {:.2} s",
        ready.as_secs_f64(),
        stopped.as_secs_f64()
    );
}
