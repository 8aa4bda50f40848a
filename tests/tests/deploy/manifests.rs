//! Manifests that run: the Helm chart rendered for each example values
//! file, and every container of every Deployment and StatefulSet started as
//! a local process with exactly the command, args and env the chart renders.
//! Only what a cluster would supply is translated: downward-API fields,
//! ConfigMap and Secret references, `$(VAR)` expansion, container ports
//! (each gets a free local port per replica), Service and pod DNS names
//! (loopback and the mapped port of a backing pod) and volume mounts (a
//! scratch directory). The containers' own probes decide readiness; then
//! one OpenAI request goes through the router's Service. A flag, env var,
//! port or probe path that the binary does not accept fails the test.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Value, json};
use tandem_tests::cluster::{expected, long_prompt};
use tandem_tests::{binary, gguf_path, http, metric};

const RELEASE: &str = "t";
const NAMESPACE: &str = "tandem";
/// Every probe of every container must pass within this (model loads take
/// a few seconds per process on 2 cores, and they load side by side).
const STARTUP_BUDGET: Duration = Duration::from_secs(180);
/// TANDEM_* variables the binary reads outside its flags.
const NON_FLAG_ENV: &[&str] = &["TANDEM_LOG"];

// ---------------------------------------------------------------- rendering

/// helm as scripts/deploy-tools.sh installs it (or `TANDEM_HELM`).
fn helm() -> PathBuf {
    let p = tandem_testkit::cached_path("TANDEM_HELM", "tools/bin/helm");
    assert!(
        p.is_file(),
        "helm is missing at {} ($TANDEM_HELM, else the cache): run scripts/deploy-tools.sh, which installs it",
        p.display()
    );
    p
}

/// `helm template` of the chart with one example values file and `extra`
/// helm arguments.
fn render(values: &str, extra: &[String], scratch: &Path) -> Vec<Value> {
    let chart = tandem_tests::repo_root().join("deploy/helm/tandem");
    let file = tandem_tests::repo_root()
        .join("deploy/helm/values")
        .join(format!("{values}.yaml"));
    assert!(file.is_file(), "no values file {}", file.display());
    let home = scratch.join("helm");
    let mut cmd = Command::new(helm());
    cmd.args(["template", RELEASE])
        .arg(&chart)
        .args(["--namespace", NAMESPACE, "-f"])
        .arg(&file)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .args(extra);
    let out = cmd.output().unwrap_or_else(|e| panic!("running helm: {e}"));
    assert!(
        out.status.success(),
        "helm template {values} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_documents(&String::from_utf8(out.stdout).unwrap())
        .unwrap_or_else(|e| panic!("helm template {values}: {e}"))
}

/// The documents of a multi-document YAML stream (empty ones dropped).
fn parse_documents(yaml: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let v = Value::deserialize(doc).map_err(|e| format!("not YAML: {e}"))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn text<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn name_of(v: &Value) -> &str {
    v["metadata"]["name"].as_str().unwrap_or("")
}

fn of_kind<'a>(docs: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| text(d, "kind") == Some(kind))
}

/// A list of strings (command, args), strictly: Kubernetes takes no other.
fn strings(v: &Value, what: &str) -> Result<Vec<String>, String> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{what}: {i} is not a string"))
            })
            .collect(),
        other => Err(format!("{what}: {other} is not a list")),
    }
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// The containers of a pod template, init containers first.
fn containers(pod_spec: &Value) -> impl Iterator<Item = (bool, &Value)> {
    let init = pod_spec["initContainers"].as_array().map_or(0, Vec::len);
    pod_spec["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(pod_spec["containers"].as_array().into_iter().flatten())
        .enumerate()
        .map(move |(i, c)| (i < init, c))
}

// ------------------------------------------------- checks against the binary

/// What `tandem <sub> --help` prints, once per subcommand.
fn tandem_help(sub: &str) -> Result<String, String> {
    static HELP: Mutex<BTreeMap<String, Result<String, String>>> = Mutex::new(BTreeMap::new());
    let mut cache = HELP.lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry(sub.to_string())
        .or_insert_with(|| {
            // A clean environment, so clap shows `[env: NAME=]` unfilled.
            let out = Command::new(binary())
                .args([sub, "--help"])
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .output()
                .map_err(|e| format!("running tandem: {e}"))?;
            if out.status.success() {
                Ok(String::from_utf8_lossy(&out.stdout).into_owned())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
            }
        })
        .clone()
}

/// Whether `flag` (`--name` or `-x`) is one of the options `help` lists
/// (clap's layout: `  -h, --help` or `      --port <PORT>` opening a line;
/// a flag only named in some description does not count).
fn help_has_flag(help: &str, flag: &str) -> bool {
    help.lines().any(|line| {
        line.trim_start()
            .split(' ')
            .take_while(|t| t.starts_with('-'))
            .any(|t| t.trim_end_matches(',') == flag)
    })
}

/// Every flag and TANDEM_* variable of every `tandem` container, checked
/// against the binary's own help; one line per thing it does not accept.
fn check_against_binary(docs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    for w in workloads(docs) {
        for (_, c) in containers(&w.template["spec"]) {
            let label = format!("{} {}/{}", w.kind, w.name, text(c, "name").unwrap_or("?"));
            let argv = match (
                strings(&c["command"], "command"),
                strings(&c["args"], "args"),
            ) {
                (Ok(cmd), Ok(args)) if cmd.first().map(String::as_str) == Some("tandem") => {
                    cmd[1..].iter().chain(&args).cloned().collect::<Vec<_>>()
                }
                (Ok(_), Ok(_)) => continue,
                (Err(e), _) | (_, Err(e)) => {
                    problems.push(format!("{label}: {e}"));
                    continue;
                }
            };
            let Some(sub) = argv.first().filter(|s| !s.starts_with('-')) else {
                problems.push(format!("{label}: args start with no subcommand: {argv:?}"));
                continue;
            };
            let help = match tandem_help(sub) {
                Ok(h) => h,
                Err(e) => {
                    problems.push(format!("{label}: `tandem {sub}` is refused: {e}"));
                    continue;
                }
            };
            for a in &argv[1..] {
                let flag = if a.starts_with("--") {
                    a.split('=').next().unwrap()
                } else if a.len() >= 2
                    && a.starts_with('-')
                    && a.as_bytes()[1].is_ascii_alphabetic()
                {
                    &a[..2]
                } else {
                    continue;
                };
                if !help_has_flag(&help, flag) {
                    problems.push(format!("{label}: `tandem {sub}` has no flag {flag}"));
                }
            }
            let mut names: Vec<String> = c["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| Some(text(e, "name")?.to_string()))
                .collect();
            // Whole ConfigMaps or Secrets as env (what is not rendered
            // fails later, when the environment is resolved).
            for from in c["envFrom"].as_array().into_iter().flatten() {
                let prefix = text(from, "prefix").unwrap_or("");
                for (kind, key) in [("ConfigMap", "configMapRef"), ("Secret", "secretRef")] {
                    let name = from[key]["name"].as_str().unwrap_or("");
                    let data = object_data(docs, kind, name).unwrap_or_default();
                    names.extend(data.into_keys().map(|k| format!("{prefix}{k}")));
                }
            }
            for name in names.iter().filter(|n| n.starts_with("TANDEM_")) {
                if !NON_FLAG_ENV.contains(&name.as_str())
                    && !help.contains(&format!("[env: {name}="))
                {
                    problems.push(format!("{label}: `tandem {sub}` reads no env var {name}"));
                }
            }
        }
    }
    problems
}

// ------------------------------------------------------------ pods and ports

#[derive(Debug)]
struct Workload<'a> {
    kind: &'a str,
    name: &'a str,
    replicas: usize,
    template: &'a Value,
    /// The governing (headless) Service of a StatefulSet.
    service_name: Option<&'a str>,
    claims: Vec<&'a str>,
}

fn workloads(docs: &[Value]) -> Vec<Workload<'_>> {
    docs.iter()
        .filter_map(|d| {
            let kind = text(d, "kind")?;
            if kind != "Deployment" && kind != "StatefulSet" {
                return None;
            }
            let spec = &d["spec"];
            Some(Workload {
                kind,
                name: name_of(d),
                replicas: spec["replicas"].as_u64().unwrap_or(1) as usize,
                template: &spec["template"],
                service_name: text(spec, "serviceName"),
                claims: spec["volumeClaimTemplates"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(name_of)
                    .collect(),
            })
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Port {
    name: Option<String>,
    number: u16,
    local: u16,
}

/// One replica of a workload.
#[derive(Debug)]
struct Pod {
    name: String,
    stateful: bool,
    service_name: Option<String>,
    labels: BTreeMap<String, String>,
    spec: Value,
    claims: Vec<String>,
    ports: Vec<Port>,
    /// The `tandem` subcommands its containers run.
    roles: Vec<String>,
    dir: PathBuf,
}

impl Pod {
    /// The local port of a container port, by number.
    fn local(&self, number: u16) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.number == number)
            .map(|p| p.local)
    }

    /// A probe's or Service's port: a number or a container port's name.
    fn resolve(&self, port: &Value) -> Result<u16, String> {
        let found = match port {
            Value::Number(n) => n.as_u64().and_then(|n| self.local(n as u16)),
            Value::String(s) => match s.parse::<u16>() {
                Ok(n) => self.local(n),
                Err(_) => self
                    .ports
                    .iter()
                    .find(|p| p.name.as_deref() == Some(s))
                    .map(|p| p.local),
            },
            _ => None,
        };
        found.ok_or_else(|| format!("pod {}: no containerPort {port}", self.name))
    }

    fn has_role(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }
}

#[derive(Debug)]
struct Service {
    name: String,
    selector: BTreeMap<String, String>,
    /// (port, targetPort)
    ports: Vec<(u16, Value)>,
}

/// The rendered objects as one machine sees them: pods with their local
/// ports, Services, ConfigMaps and Secrets.
#[derive(Debug)]
struct Net {
    docs: Vec<Value>,
    pods: Vec<Pod>,
    services: Vec<Service>,
}

impl Net {
    fn new(docs: Vec<Value>, scratch: &Path) -> Result<Net, String> {
        // Listeners held until every port is chosen, so no two are equal.
        let mut held = Vec::new();
        let mut pods = Vec::new();
        for w in workloads(&docs) {
            let spec = &w.template["spec"];
            for i in 0..w.replicas {
                let name = format!("{}-{i}", w.name);
                let mut ports = Vec::new();
                let mut roles = Vec::new();
                for (init, c) in containers(spec) {
                    let cmd = strings(&c["command"], "command")?;
                    let args = strings(&c["args"], "args")?;
                    if cmd.first().map(String::as_str) == Some("tandem") && !init {
                        roles.extend(cmd[1..].iter().chain(&args).next().cloned());
                    }
                    for p in c["ports"].as_array().into_iter().flatten() {
                        let number = p["containerPort"]
                            .as_u64()
                            .and_then(|n| u16::try_from(n).ok())
                            .ok_or_else(|| format!("{name}: bad containerPort in {p}"))?;
                        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
                        ports.push(Port {
                            name: text(p, "name").map(str::to_string),
                            number,
                            local: l.local_addr().unwrap().port(),
                        });
                        held.push(l);
                    }
                }
                let dir = scratch.join(&name);
                std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                pods.push(Pod {
                    stateful: w.kind == "StatefulSet",
                    service_name: w.service_name.map(str::to_string),
                    labels: labels(&w.template["metadata"]["labels"]),
                    spec: spec.clone(),
                    claims: w.claims.iter().map(|s| s.to_string()).collect(),
                    ports,
                    roles,
                    dir,
                    name,
                });
            }
        }
        let services = of_kind(&docs, "Service")
            .map(|s| Service {
                name: name_of(s).to_string(),
                selector: labels(&s["spec"]["selector"]),
                ports: s["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| {
                        let port = u16::try_from(p["port"].as_u64()?).ok()?;
                        let target = p.get("targetPort").cloned().unwrap_or(json!(port));
                        Some((port, target))
                    })
                    .collect(),
            })
            .collect();
        Ok(Net {
            docs,
            pods,
            services,
        })
    }

    fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).unwrap()
    }

    fn selects(svc: &Service, pod: &Pod) -> bool {
        !svc.selector.is_empty()
            && svc
                .selector
                .iter()
                .all(|(k, v)| pod.labels.get(k) == Some(v))
    }

    /// `127.0.0.1:<local port>` behind a Service port: the first ready
    /// backing pod (the first one at all while none is ready yet).
    fn service_port(
        &self,
        svc: &Service,
        port: u16,
        ready: &HashSet<String>,
    ) -> Result<u16, String> {
        let (_, target) = svc
            .ports
            .iter()
            .find(|(p, _)| *p == port)
            .ok_or_else(|| format!("Service {} has no port {port}", svc.name))?;
        let backends: Vec<&Pod> = self.pods.iter().filter(|p| Self::selects(svc, p)).collect();
        let pod = backends
            .iter()
            .find(|p| ready.contains(&p.name))
            .or(backends.first())
            .ok_or_else(|| format!("Service {} selects no pod", svc.name))?;
        pod.resolve(target)
    }

    /// What a DNS name refers to: a Service (`svc`, `svc.ns`, `svc.ns.svc`,
    /// `svc.ns.svc.cluster.local`) or a pod behind its headless Service
    /// (`pod.svc` and the same suffixes).
    fn classify(&self, host: &str) -> Option<Target<'_>> {
        let host = host.trim_end_matches('.');
        let base = [
            format!(".{NAMESPACE}.svc.cluster.local"),
            format!(".{NAMESPACE}.svc"),
            format!(".{NAMESPACE}"),
        ]
        .iter()
        .find_map(|s| host.strip_suffix(s.as_str()))
        .unwrap_or(host);
        if let Some(svc) = self.services.iter().find(|s| s.name == base) {
            return Some(Target::Service(svc));
        }
        let (pod, svc) = base.split_once('.')?;
        let pod = self.pods.iter().find(|p| p.name == pod)?;
        let governed = pod.service_name.as_deref() == Some(svc)
            || self
                .services
                .iter()
                .any(|s| s.name == svc && Self::selects(s, pod));
        governed.then_some(Target::Pod(pod))
    }

    /// `host[:port]` as seen from `own`: loopback binds keep their host and
    /// get `own`'s local port; Service and pod names become 127.0.0.1 and
    /// the local port of the pod they reach. None: leave it as it is.
    fn map_host(
        &self,
        own: &Pod,
        host: &str,
        port: Option<u16>,
        scheme: Option<&str>,
        ready: &HashSet<String>,
    ) -> Result<Option<String>, String> {
        if ["0.0.0.0", "127.0.0.1", "localhost"].contains(&host) {
            return Ok(port
                .and_then(|p| own.local(p))
                .map(|l| format!("{host}:{l}")));
        }
        let Some(target) = self.classify(host) else {
            return Ok(None);
        };
        let port = match (port, scheme) {
            (Some(p), _) => p,
            (None, Some("http")) => 80,
            (None, Some("https")) => 443,
            // A bare name may be a coincidence (a cluster name, a token).
            (None, _) => return Ok(None),
        };
        let local = match target {
            Target::Service(svc) => self.service_port(svc, port, ready)?,
            Target::Pod(pod) => pod
                .local(port)
                .ok_or_else(|| format!("{host}: pod {} has no containerPort {port}", pod.name))?,
        };
        Ok(Some(format!("127.0.0.1:{local}")))
    }

    /// Every `host[:port]` in `s` mapped as `map_host` says.
    fn rewrite_hosts(&self, own: &Pod, s: &str, ready: &HashSet<String>) -> Result<String, String> {
        let hostish = |b: u8| b.is_ascii_alphanumeric() || b == b'.' || b == b'-';
        let b = s.as_bytes();
        let (mut out, mut copied, mut i) = (String::new(), 0, 0);
        while i < b.len() {
            if !hostish(b[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < b.len() && hostish(b[i]) {
                i += 1;
            }
            let mut end = i;
            let mut port = None;
            if b.get(i) == Some(&b':') {
                let digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
                let after = b.get(i + 1 + digits).copied();
                if digits > 0 && !after.is_some_and(hostish) {
                    port = s[i + 1..i + 1 + digits].parse::<u16>().ok();
                    if port.is_some() {
                        end = i + 1 + digits;
                    }
                }
            }
            let scheme = s[..start].strip_suffix("://").map(|p| {
                p.rsplit(|c: char| !c.is_ascii_alphanumeric())
                    .next()
                    .unwrap_or("")
            });
            if let Some(new) = self.map_host(own, &s[start..i], port, scheme, ready)? {
                out.push_str(&s[copied..start]);
                out.push_str(&new);
                copied = end;
                i = end;
            }
        }
        out.push_str(&s[copied..]);
        Ok(out)
    }
}

#[derive(Debug)]
enum Target<'a> {
    Service(&'a Service),
    Pod(&'a Pod),
}

// ------------------------------------------------------ environment, volumes

/// A ConfigMap's or Secret's entries as text.
fn object_data(docs: &[Value], kind: &str, name: &str) -> Option<BTreeMap<String, String>> {
    let obj = of_kind(docs, kind).find(|d| name_of(d) == name)?;
    let mut data = BTreeMap::new();
    for (k, v) in obj["data"].as_object().into_iter().flatten() {
        let v = v.as_str()?;
        let v = if kind == "Secret" {
            String::from_utf8(base64(v)?).ok()?
        } else {
            v.to_string()
        };
        data.insert(k.clone(), v);
    }
    for (k, v) in obj["stringData"].as_object().into_iter().flatten() {
        data.insert(k.clone(), v.as_str()?.to_string());
    }
    Some(data)
}

fn base64(s: &str) -> Option<Vec<u8>> {
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in s.bytes().filter(|c| !c.is_ascii_whitespace() && *c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        bits = (bits << 6) | u32::from(v);
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
        }
    }
    Some(out)
}

/// Kubernetes' `$(VAR)` expansion (`$$` is a literal `$`); a reference to
/// a variable the container does not define fails instead of staying
/// literal, since no process wants the text `$(VAR)`.
fn expand(s: &str, env: &[(String, String)]) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some((name, t)) = tail.strip_prefix("$(").and_then(|t| t.split_once(')')) {
            let v = env
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .ok_or_else(|| format!("$({name}) names no env var of the container"))?;
            out.push_str(&v.1);
            rest = t;
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// The container's environment as the kubelet would set it.
fn resolve_env(docs: &[Value], pod: &Pod, c: &Value) -> Result<Vec<(String, String)>, String> {
    let mut env: Vec<(String, String)> = Vec::new();
    for from in c["envFrom"].as_array().into_iter().flatten() {
        let prefix = text(from, "prefix").unwrap_or("");
        let (kind, r) = match (from.get("configMapRef"), from.get("secretRef")) {
            (Some(r), _) => ("ConfigMap", r),
            (_, Some(r)) => ("Secret", r),
            _ => return Err(format!("envFrom {from}: unsupported")),
        };
        let name = text(r, "name").unwrap_or("");
        match object_data(docs, kind, name) {
            Some(data) => env.extend(data.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v))),
            None if r["optional"] == json!(true) => {}
            None => return Err(format!("envFrom: no {kind} {name}")),
        }
    }
    for e in c["env"].as_array().into_iter().flatten() {
        let name = text(e, "name").ok_or_else(|| format!("env entry without a name: {e}"))?;
        let value = match (e.get("value"), e.get("valueFrom")) {
            (Some(Value::String(v)), None) => Some(expand(v, &env)?),
            (None, None) => Some(String::new()),
            (None, Some(from)) => {
                value_from(docs, pod, from).map_err(|why| format!("env {name}: {why}"))?
            }
            _ => {
                return Err(format!(
                    "env {name}: neither a string value nor valueFrom: {e}"
                ));
            }
        };
        if let Some(v) = value {
            env.retain(|(k, _)| k != name);
            env.push((name.to_string(), v));
        }
    }
    Ok(env)
}

/// A `valueFrom`; None for an optional reference to nothing.
fn value_from(docs: &[Value], pod: &Pod, from: &Value) -> Result<Option<String>, String> {
    if let Some(path) = from["fieldRef"]["fieldPath"].as_str() {
        let label = path
            .strip_prefix("metadata.labels['")
            .and_then(|l| l.strip_suffix("']"));
        return match (path, label) {
            ("metadata.name", _) => Ok(Some(pod.name.clone())),
            ("metadata.namespace", _) => Ok(Some(NAMESPACE.to_string())),
            // Every pod of this "cluster" lives on loopback.
            ("status.podIP" | "status.hostIP", _) => Ok(Some("127.0.0.1".to_string())),
            (_, Some(l)) => pod
                .labels
                .get(l)
                .cloned()
                .map(Some)
                .ok_or_else(|| format!("pod has no label {l}")),
            _ => Err(format!("fieldRef {path} cannot be resolved here")),
        };
    }
    for (key, kind) in [("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")] {
        if let Some(r) = from.get(key) {
            let name = text(r, "name").unwrap_or("");
            let k = text(r, "key").unwrap_or("");
            let found = object_data(docs, kind, name).and_then(|d| d.get(k).cloned());
            return match found {
                Some(v) => Ok(Some(v)),
                None if r["optional"] == json!(true) => Ok(None),
                None => Err(format!("no key {k} in rendered {kind} {name}")),
            };
        }
    }
    Err(format!("valueFrom {from} cannot be resolved here"))
}

/// Each volume of the pod as a scratch directory (ConfigMap and Secret
/// volumes filled with their entries); mount path -> local path.
fn mounts(docs: &[Value], pod: &Pod, c: &Value) -> Result<Vec<(String, PathBuf)>, String> {
    let mut out = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let vname = text(m, "name").unwrap_or("");
        let path = text(m, "mountPath").unwrap_or("");
        let dir = pod.dir.join("volumes").join(vname);
        let vol = pod.spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| name_of_volume(v) == vname);
        let files = match vol {
            None if pod.claims.iter().any(|c| c == vname) => None,
            None => {
                return Err(format!(
                    "{}: volumeMount of undeclared volume {vname}",
                    pod.name
                ));
            }
            Some(v) if v.get("emptyDir").is_some() || v.get("persistentVolumeClaim").is_some() => {
                None
            }
            Some(v) if v.get("configMap").is_some() => {
                let name = text(&v["configMap"], "name").unwrap_or("");
                Some(object_data(docs, "ConfigMap", name).ok_or(format!("no ConfigMap {name}"))?)
            }
            Some(v) if v.get("secret").is_some() => {
                let name = text(&v["secret"], "secretName").unwrap_or("");
                Some(object_data(docs, "Secret", name).ok_or(format!("no Secret {name}"))?)
            }
            Some(v) => return Err(format!("{}: volume {v} has no local equivalent", pod.name)),
        };
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        for (k, v) in files.into_iter().flatten() {
            std::fs::write(dir.join(k), v).map_err(|e| e.to_string())?;
        }
        let local = match text(m, "subPath") {
            Some(sub) => dir.join(sub),
            None => dir,
        };
        out.push((path.trim_end_matches('/').to_string(), local));
    }
    // Longest first, so a nested mount wins over its parent.
    out.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    Ok(out)
}

fn name_of_volume(v: &Value) -> &str {
    text(v, "name").unwrap_or("")
}

/// Mount paths in `s` (whole path components) replaced by their local dirs.
fn remap_paths(s: &str, mounts: &[(String, PathBuf)]) -> String {
    for (mount, local) in mounts {
        let mut hit = None;
        for (i, _) in s.match_indices(mount.as_str()) {
            let before = s[..i].chars().next_back();
            let after = s[i + mount.len()..].chars().next();
            let starts = before.is_none_or(|c| "=:, \"'".contains(c));
            let ends = after.is_none_or(|c| "/=:, \"'".contains(c));
            if starts && ends {
                hit = Some(i);
                break;
            }
        }
        if let Some(i) = hit {
            let rest = remap_paths(&s[i + mount.len()..], mounts);
            return format!("{}{}{rest}", &s[..i], local.display());
        }
    }
    s.to_string()
}

// ----------------------------------------------------------- launch plans

#[derive(Debug, Clone, PartialEq)]
enum Check {
    Http { port: u16, path: String },
    Tcp { port: u16 },
    Exec(Vec<String>),
}

#[derive(Debug, Clone)]
struct Probe {
    kind: &'static str,
    check: Check,
}

/// A container as a local process.
#[derive(Debug)]
struct Launch {
    label: String,
    init: bool,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    probes: Vec<Probe>,
    dir: PathBuf,
}

/// The local program for a container's `command[0]`.
fn program(name: &str) -> Result<PathBuf, String> {
    match name {
        "tandem" => Ok(binary()),
        "etcd" => Ok(which("etcd").unwrap_or_else(|| {
            panic!("etcd is not on PATH: install Debian's etcd-server (scripts/test.sh does)")
        })),
        other => Err(format!("command {other} has no local equivalent here")),
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn is_own_port(pod: &Pod, v: &str) -> Option<u16> {
    v.parse::<u16>().ok().and_then(|n| pod.local(n))
}

/// Everything one container needs to run here, or why it cannot.
fn plan_container(
    net: &Net,
    pod: &Pod,
    c: &Value,
    init: bool,
    ready: &HashSet<String>,
) -> Result<Launch, String> {
    let cname = text(c, "name").unwrap_or("?");
    let label = format!("{}/{cname}", pod.name);
    let at = |e: String| format!("{label}: {e}");
    let command = strings(&c["command"], "command").map_err(at)?;
    let Some(first) = command.first() else {
        return Err(at("no command (the chart must name the program)".into()));
    };
    let program = program(first).map_err(at)?;
    let env_raw = resolve_env(&net.docs, pod, c).map_err(at)?;
    let mounts = mounts(&net.docs, pod, c).map_err(at)?;
    let mut args: Vec<String> = command[1..]
        .iter()
        .chain(&strings(&c["args"], "args").map_err(at)?)
        .map(|a| expand(a, &env_raw))
        .collect::<Result<_, _>>()
        .map_err(at)?;
    for i in 0..args.len() {
        let mut a = remap_paths(
            &net.rewrite_hosts(pod, &args[i], ready).map_err(at)?,
            &mounts,
        );
        // The container's own port as the value of a port flag (`--port
        // 8000`, `--metrics-port=9090`; not `--max-length 8000`).
        let port_flag = |f: &str| f.starts_with('-') && f.to_ascii_lowercase().contains("port");
        if let Some((flag, v)) = a.split_once('=')
            && port_flag(flag)
            && let Some(l) = is_own_port(pod, v)
        {
            a = format!("{flag}={l}");
        } else if i > 0
            && port_flag(&args[i - 1])
            && !args[i - 1].contains('=')
            && let Some(l) = is_own_port(pod, &a)
        {
            a = l.to_string();
        }
        args[i] = a;
    }
    // Data directories outside any volume: a read-only root filesystem
    // refuses them in a cluster, so here too; otherwise they get scratch
    // space rather than this machine's root filesystem.
    let read_only = c["securityContext"]["readOnlyRootFilesystem"] == json!(true);
    let unmounted = |what: &str, v: &str| -> Result<Option<String>, String> {
        if !v.starts_with('/') || Path::new(v).starts_with(&pod.dir) {
            return Ok(None);
        }
        if read_only {
            return Err(at(format!(
                "{what} {v} is on no volume, and the root filesystem is read-only"
            )));
        }
        let local = pod.dir.join(what.trim_start_matches('-'));
        Ok(Some(local.display().to_string()))
    };
    let dir_flag = |f: &str| f.starts_with("--") && f.ends_with("-dir");
    for i in 0..args.len() {
        if let Some((flag, v)) = args[i].split_once('=')
            && dir_flag(flag)
        {
            if let Some(d) = unmounted(flag, v)? {
                args[i] = format!("{flag}={d}");
            }
        } else if i > 0
            && dir_flag(&args[i - 1])
            && let Some(d) = unmounted(&args[i - 1], &args[i])?
        {
            args[i] = d;
        }
    }
    let mut env = Vec::new();
    for (k, v) in &env_raw {
        let mut v = remap_paths(&net.rewrite_hosts(pod, v, ready).map_err(at)?, &mounts);
        if k.contains("PORT")
            && let Some(l) = is_own_port(pod, &v)
        {
            v = l.to_string();
        }
        if k == "TANDEM_CACHE"
            && let Some(d) = unmounted(k, &v)?
        {
            v = d;
        }
        env.push((k.clone(), v));
    }
    let mut probes = Vec::new();
    for kind in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let Some(p) = c.get(kind).filter(|p| !p.is_null()) else {
            continue;
        };
        let check = if let Some(h) = p.get("httpGet") {
            if text(h, "scheme").is_some_and(|s| s != "HTTP") {
                return Err(at(format!("{kind}: only HTTP probes run here: {h}")));
            }
            Check::Http {
                port: pod
                    .resolve(&h["port"])
                    .map_err(|e| at(format!("{kind}: {e}")))?,
                path: text(h, "path").unwrap_or("/").to_string(),
            }
        } else if let Some(t) = p.get("tcpSocket") {
            Check::Tcp {
                port: pod
                    .resolve(&t["port"])
                    .map_err(|e| at(format!("{kind}: {e}")))?,
            }
        } else if let Some(x) = p.get("exec") {
            let argv = strings(&x["command"], kind).map_err(at)?;
            Check::Exec(
                argv.iter()
                    .map(|a| net.rewrite_hosts(pod, a, ready))
                    .collect::<Result<_, _>>()
                    .map_err(at)?,
            )
        } else {
            return Err(at(format!("{kind}: no handler this runner knows: {p}")));
        };
        probes.push(Probe { kind, check });
    }
    Ok(Launch {
        label,
        init,
        program,
        args,
        env,
        probes,
        dir: pod.dir.clone(),
    })
}

// ------------------------------------------------------------------ probes

#[derive(Debug, PartialEq)]
enum Outcome {
    Pass,
    NotYet(String),
    /// A fault that waiting cannot fix (a path the server does not have).
    Fatal(String),
}

fn check(c: &Check) -> Outcome {
    match c {
        Check::Http { port, path } => match http_status(*port, path) {
            Ok(code) if (200..400).contains(&code) => Outcome::Pass,
            Ok(code) if (400..500).contains(&code) && code != 408 && code != 429 => {
                Outcome::Fatal(format!("GET {path} on port {port} answered {code}"))
            }
            Ok(code) => Outcome::NotYet(format!("answered {code}")),
            Err(e) => Outcome::NotYet(e),
        },
        Check::Tcp { port } => {
            let addr = SocketAddr::from(([127, 0, 0, 1], *port));
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(_) => Outcome::Pass,
                Err(e) => Outcome::NotYet(e.to_string()),
            }
        }
        Check::Exec(argv) => exec_probe(argv),
    }
}

/// The status code of `GET path`, with short timeouts (a probe's).
fn http_status(port: u16, path: &str) -> Result<u16, String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut head = [0u8; 32];
    let mut n = 0;
    while n < head.len() {
        match s.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(e.to_string()),
        }
    }
    let line = String::from_utf8_lossy(&head[..n]);
    line.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no HTTP status line: {line:?}"))
}

fn exec_probe(argv: &[String]) -> Outcome {
    let Some(prog) = argv.first().and_then(|p| which(p)) else {
        return Outcome::Fatal(format!("exec probe {argv:?}: no such program here"));
    };
    let mut child = match Command::new(prog)
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return Outcome::Fatal(format!("exec probe {argv:?}: {e}")),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Outcome::Pass,
            Ok(Some(st)) => return Outcome::NotYet(format!("exited {st}")),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Outcome::NotYet("timed out".into());
            }
        }
    }
}

// --------------------------------------------------------------- processes

/// A container's process; killed on drop.
#[derive(Debug)]
struct Running {
    label: String,
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Running {
    fn spawn(l: &Launch) -> Running {
        // A container's environment: only what its spec sets, plus what
        // any process needs (PATH) and what the kubelet sets (HOSTNAME).
        let mut cmd = Command::new(&l.program);
        cmd.args(&l.args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", &l.dir)
            .env("HOSTNAME", l.label.split('/').next().unwrap())
            .envs(l.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&l.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {} ({}): {e}", l.label, l.program.display()));
        let log = Arc::new(Mutex::new(String::new()));
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().unwrap());
        for pipe in [out, err] {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        Running {
            label: l.label.clone(),
            child,
            log,
        }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last lines it printed (both streams).
    fn tail(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Started {
    launch: Launch,
    proc: Running,
    passed: Vec<bool>,
}

/// The rendered workloads running here; stopped in reverse start order
/// (routers, then nodes, then etcd), as the chart drains them.
#[derive(Debug)]
struct LocalCluster {
    net: Net,
    started: Vec<Started>,
    ready: HashSet<String>,
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        while let Some(s) = self.started.pop() {
            drop(s);
        }
    }
}

impl LocalCluster {
    /// StatefulSets (etcd) first, up to their probes; then the
    /// Deployments, nodes before front ends, up to theirs.
    fn start(net: Net) -> LocalCluster {
        let deadline = Instant::now() + STARTUP_BUDGET;
        let rank = |p: &Pod| {
            if p.stateful {
                0
            } else if p.has_role("router") || p.has_role("serve") {
                2
            } else {
                1
            }
        };
        let mut order: Vec<usize> = (0..net.pods.len()).collect();
        order.sort_by_key(|&i| rank(&net.pods[i]));
        let waves: Vec<Vec<usize>> = [
            order
                .iter()
                .copied()
                .filter(|&i| net.pods[i].stateful)
                .collect(),
            order
                .iter()
                .copied()
                .filter(|&i| !net.pods[i].stateful)
                .collect(),
        ]
        .into();
        let mut cluster = LocalCluster {
            net,
            started: Vec::new(),
            ready: HashSet::new(),
        };
        for wave in waves {
            let first = cluster.started.len();
            for &p in &wave {
                cluster.start_pod(p, deadline);
            }
            cluster.wait_probes(first, deadline);
            for &p in &wave {
                cluster.ready.insert(cluster.net.pods[p].name.clone());
            }
        }
        cluster
    }

    fn start_pod(&mut self, p: usize, deadline: Instant) {
        let pod = &self.net.pods[p];
        for (init, c) in containers(&pod.spec) {
            let launch = plan_container(&self.net, pod, c, init, &self.ready)
                .unwrap_or_else(|e| panic!("{e}"));
            let mut proc = Running::spawn(&launch);
            if launch.init {
                // An init container runs to completion before the others.
                let status = loop {
                    if let Some(st) = proc.exited() {
                        break st;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "init container {} never finished:\n{}",
                        launch.label,
                        proc.tail()
                    );
                    std::thread::sleep(Duration::from_millis(100));
                };
                assert!(
                    status.success(),
                    "init container {} failed ({status}):\n{}",
                    launch.label,
                    proc.tail()
                );
                continue;
            }
            let passed = vec![false; launch.probes.len()];
            self.started.push(Started {
                launch,
                proc,
                passed,
            });
        }
    }

    /// Polls the probes of the containers started from `first` on until
    /// each has passed once (startup probes before the others).
    fn wait_probes(&mut self, first: usize, deadline: Instant) {
        loop {
            let mut pending = Vec::new();
            for s in &mut self.started[first..] {
                if let Some(st) = s.proc.exited() {
                    panic!(
                        "{} ({} {}) exited during startup ({st}):\n{}",
                        s.launch.label,
                        s.launch.program.display(),
                        s.launch.args.join(" "),
                        s.proc.tail()
                    );
                }
                let startup_done = s
                    .launch
                    .probes
                    .iter()
                    .zip(&s.passed)
                    .all(|(p, ok)| p.kind != "startupProbe" || *ok);
                for (p, ok) in s.launch.probes.iter().zip(s.passed.iter_mut()) {
                    if *ok {
                        continue;
                    }
                    if p.kind != "startupProbe" && !startup_done {
                        let why = format!("{} waits for the startup probe", p.kind);
                        pending.push((s.launch.label.clone(), why));
                        continue;
                    }
                    match check(&p.check) {
                        Outcome::Pass => *ok = true,
                        Outcome::NotYet(why) => pending.push((
                            s.launch.label.clone(),
                            format!("{} {:?}: {why}", p.kind, p.check),
                        )),
                        Outcome::Fatal(why) => panic!(
                            "{} {} {:?}: {why}\n{}",
                            s.launch.label,
                            p.kind,
                            p.check,
                            s.proc.tail()
                        ),
                    }
                }
            }
            if pending.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self.started[first..]
                    .iter()
                    .filter(|s| pending.iter().any(|(l, _)| *l == s.launch.label))
                    .map(|s| format!("--- {}:\n{}", s.launch.label, s.proc.tail()))
                    .collect();
                let why: Vec<String> = pending.iter().map(|(l, w)| format!("{l} {w}")).collect();
                panic!(
                    "probes still failing after {STARTUP_BUDGET:?}:\n{}\n{}",
                    why.join("\n"),
                    logs.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The local port behind the Service in front of `role` pods.
    fn front_port(&self, role: &str) -> Option<u16> {
        self.net.services.iter().find_map(|svc| {
            let fronts = self
                .net
                .pods
                .iter()
                .any(|p| Net::selects(svc, p) && p.has_role(role));
            let (port, _) = svc.ports.first()?;
            fronts.then(|| self.net.service_port(svc, *port, &self.ready).unwrap())
        })
    }

    fn pods_with(&self, role: &str) -> Vec<&Pod> {
        self.net.pods.iter().filter(|p| p.has_role(role)).collect()
    }

    fn logs(&self) -> String {
        self.started
            .iter()
            .map(|s| format!("--- {}:\n{}", s.proc.label, s.proc.tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

// ------------------------------------------------------------------- tests

/// The manifest tests load several models each: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Chart values for this machine: the test model, and processes sized for
/// 2 cores through the chart's own knobs and its extra-args hook (nothing
/// the chart renders is overridden after rendering).
fn laptop_values() -> Vec<String> {
    let mut v = vec![
        "--set-string".to_string(),
        format!("model.name={}", gguf_path().display()),
        "--set".to_string(),
        "maxLength=512".to_string(),
    ];
    for role in ["prefill", "decode", "serve"] {
        v.push("--set".to_string());
        v.push(format!("{role}.threads=1"));
        v.push("--set-json".to_string());
        v.push(format!(r#"{role}.extraArgs=["--kv-cache-blocks","256"]"#));
    }
    v
}

fn run_values(values: &str) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = tempfile::tempdir().unwrap();
    let docs = render(values, &laptop_values(), scratch.path());
    let problems = check_against_binary(&docs);
    assert!(
        problems.is_empty(),
        "{values}: the binary refuses:\n{}",
        problems.join("\n")
    );
    let net = Net::new(docs, scratch.path()).unwrap_or_else(|e| panic!("{values}: {e}"));
    for p in &net.pods {
        for (init, c) in containers(&p.spec) {
            let probes = ["startupProbe", "readinessProbe", "livenessProbe"];
            let tandem = c["command"][0] == json!("tandem");
            assert!(
                init || !tandem || probes.iter().any(|k| !c[*k].is_null()),
                "{values}: {}/{} has no probe",
                p.name,
                c["name"]
            );
        }
    }
    let cluster = LocalCluster::start(net);

    let (port, disaggregated) = match cluster.front_port("router") {
        Some(p) => (p, true),
        None => (
            cluster.front_port("serve").unwrap_or_else(|| {
                panic!("{values}: no Service in front of a router or serve pod")
            }),
            false,
        ),
    };
    if disaggregated {
        // The probes say a decode worker is known; the request should
        // also find every prefill worker.
        let (np, nd) = (
            cluster.pods_with("prefill").len(),
            cluster.pods_with("decode").len(),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let h = http(port, "GET", "/health", "").json();
            let n = |k: &str| h[k].as_array().map_or(0, Vec::len);
            if n("prefill_workers") == np && n("decode_workers") == nd {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{values}: router never saw {np}P{nd}D: {h}\n{}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    let prompt = long_prompt(0);
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let r = http(port, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{values}: {}\n{}", r.body, cluster.logs());
    assert_eq!(
        r.json()["choices"][0]["text"],
        json!(expected(&prompt, 8)),
        "{values}"
    );

    if disaggregated {
        // The prompt's KV came from a prefill pod over the rendered wiring.
        let moved: f64 = cluster
            .pods_with("prefill")
            .iter()
            .map(|p| {
                let port = p.resolve(&json!("metrics")).unwrap();
                metric(
                    &http(port, "GET", "/metrics", "").body,
                    "tandem_dkv_blocks_transferred_total",
                    "",
                )
            })
            .sum();
        assert!(
            moved > 0.0,
            "{values}: no prefill pod transferred KV\n{}",
            cluster.logs()
        );
    }
}

#[test]
fn aggregated_values_run() {
    run_values("aggregated");
}

#[test]
fn one_prefill_one_decode_values_run() {
    run_values("1p1d");
}

#[test]
fn heterogeneous_tp3_values_run() {
    run_values("hetero-tp3");
}

/// The runner's own check catches what the binary would refuse.
#[test]
fn unknown_flag_and_env_var_are_reported() {
    let scratch = tempfile::tempdir().unwrap();
    let mut docs = render("1p1d", &laptop_values(), scratch.path());
    assert_eq!(check_against_binary(&docs), Vec::<String>::new());
    let c = docs
        .iter_mut()
        .filter(|d| d["kind"] == json!("Deployment"))
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .unwrap()
        })
        .find(|c| c["command"][0] == json!("tandem"))
        .expect("a tandem container");
    c["args"]
        .as_array_mut()
        .unwrap()
        .push(json!("--no-such-flag"));
    c["env"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "TANDEM_NO_SUCH_SETTING", "value": "1"}));
    let problems = check_against_binary(&docs).join("\n");
    assert!(
        problems.contains("has no flag --no-such-flag"),
        "{problems}"
    );
    assert!(
        problems.contains("reads no env var TANDEM_NO_SUCH_SETTING"),
        "{problems}"
    );
}

// ------------------------------------------------- the machinery, by itself

const SMALL: &str = r#"
# Source: a comment-only document
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cfg}
data: {CLUSTER: blue, KEY: from-config}
---
apiVersion: v1
kind: Secret
metadata: {name: sec}
data: {TOKEN: c2VjcmV0LXZhbHVl}
---
apiVersion: v1
kind: Service
metadata: {name: t-etcd}
spec:
  clusterIP: None
  selector: {app: etcd}
  ports: [{name: client, port: 2379, targetPort: client}, {name: peer, port: 2380}]
---
apiVersion: v1
kind: Service
metadata: {name: t-node}
spec:
  selector: {app: node}
  ports: [{port: 80, targetPort: http}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: t-etcd}
spec:
  serviceName: t-etcd
  replicas: 1
  template:
    metadata: {labels: {app: etcd}}
    spec:
      containers:
        - name: etcd
          command: [etcd]
          args:
            - --name=$(POD_NAME)
            - --data-dir=/var/lib/etcd/data
            - --listen-client-urls=http://0.0.0.0:2379
            - --advertise-client-urls=http://$(POD_NAME).t-etcd.tandem.svc.cluster.local:2379
            - --initial-cluster=$(POD_NAME)=http://$(POD_NAME).t-etcd:2380
            - --initial-cluster-token=t-etcd
          env:
            - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
          ports: [{name: client, containerPort: 2379}, {name: peer, containerPort: 2380}]
          volumeMounts: [{name: data, mountPath: /var/lib/etcd}]
          readinessProbe: {httpGet: {path: /health, port: client}}
  volumeClaimTemplates: [{metadata: {name: data}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: t-node}
spec:
  replicas: 2
  template:
    metadata: {labels: {app: node}}
    spec:
      volumes: [{name: cache, emptyDir: {}}, {name: conf, configMap: {name: cfg}}]
      containers:
        - name: node
          command: [tandem]
          args: [decode, --host, 0.0.0.0, --port, "8000", --max-length, "8000", --cluster, t-node]
          env:
            - {name: TANDEM_ETCD, value: "http://t-etcd:2379,http://t-etcd.tandem.svc:2379"}
            - {name: TANDEM_ADVERTISE_HOST, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
            - {name: TANDEM_WORKER_ID, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
            - {name: TANDEM_CLUSTER, valueFrom: {configMapKeyRef: {name: cfg, key: CLUSTER}}}
            - {name: TOKEN, valueFrom: {secretKeyRef: {name: sec, key: TOKEN}}}
            - {name: OPTIONAL, valueFrom: {secretKeyRef: {name: sec, key: NOPE, optional: true}}}
            - {name: TANDEM_CACHE, value: /var/cache/tandem}
            - {name: TANDEM_METRICS_PORT, value: "9090"}
            - {name: ESCAPED, value: "$$(TOKEN) and $(TOKEN)"}
          ports: [{name: http, containerPort: 8000}, {name: metrics, containerPort: 9090}]
          volumeMounts: [{name: cache, mountPath: /var/cache/tandem}, {name: conf, mountPath: /etc/tandem}]
          readinessProbe: {httpGet: {path: /health, port: http}}
          livenessProbe: {tcpSocket: {port: 9090}}
"#;

fn small_net() -> (tempfile::TempDir, Net) {
    let scratch = tempfile::tempdir().unwrap();
    let docs = parse_documents(SMALL).unwrap();
    let net = Net::new(docs, scratch.path()).unwrap();
    (scratch, net)
}

fn small_plan(net: &Net, pod: &str) -> Result<Launch, String> {
    let pod = net.pod(pod);
    let c = pod.spec["containers"][0].clone();
    plan_container(net, pod, &c, false, &HashSet::new())
}

#[test]
fn machinery_parses_documents_and_replicas() {
    let (_dir, net) = small_net();
    assert_eq!(net.docs.len(), 6, "the comment-only document is dropped");
    let names: Vec<&str> = net.pods.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["t-etcd-0", "t-node-0", "t-node-1"]);
    assert_eq!(net.pod("t-node-1").roles, ["decode"]);
    let mut locals: Vec<u16> = net
        .pods
        .iter()
        .flat_map(|p| p.ports.iter().map(|x| x.local))
        .collect();
    locals.sort_unstable();
    locals.dedup();
    assert_eq!(
        locals.len(),
        6,
        "every container port of every replica gets its own local port"
    );
    assert!(parse_documents("a: [unclosed").is_err());
}

#[test]
fn machinery_resolves_env_and_rewrites_ports_hosts_and_paths() {
    let (_dir, net) = small_net();
    let etcd = net.pod("t-etcd-0");
    let (client, peer) = (etcd.local(2379).unwrap(), etcd.local(2380).unwrap());
    let node = net.pod("t-node-1");
    let (http_port, metrics) = (node.local(8000).unwrap(), node.local(9090).unwrap());

    let l = small_plan(&net, "t-node-1").unwrap();
    assert_eq!(l.program, binary());
    assert_eq!(
        l.args,
        [
            "decode",
            "--host",
            "0.0.0.0",
            "--port",
            &http_port.to_string(),
            "--max-length",
            "8000",
            "--cluster",
            "t-node"
        ],
        "own port remapped; other numbers and a bare Service-like name untouched"
    );
    let env: BTreeMap<_, _> = l.env.iter().cloned().collect();
    assert_eq!(
        env["TANDEM_ETCD"],
        format!("http://127.0.0.1:{client},http://127.0.0.1:{client}")
    );
    assert_eq!(env["TANDEM_ADVERTISE_HOST"], "127.0.0.1");
    assert_eq!(env["TANDEM_WORKER_ID"], "t-node-1");
    assert_eq!(env["TANDEM_CLUSTER"], "blue");
    assert_eq!(env["TOKEN"], "secret-value");
    assert!(!env.contains_key("OPTIONAL"));
    assert_eq!(env["TANDEM_METRICS_PORT"], metrics.to_string());
    assert_eq!(env["ESCAPED"], "$(TOKEN) and secret-value");
    assert_eq!(
        PathBuf::from(&env["TANDEM_CACHE"]),
        node.dir.join("volumes/cache")
    );
    assert_eq!(
        std::fs::read_to_string(node.dir.join("volumes/conf/KEY")).unwrap(),
        "from-config"
    );
    assert_eq!(
        l.probes.iter().map(|p| p.check.clone()).collect::<Vec<_>>(),
        [
            Check::Http {
                port: http_port,
                path: "/health".into()
            },
            Check::Tcp { port: metrics }
        ]
    );

    let e = small_plan(&net, "t-etcd-0").unwrap();
    let data = etcd.dir.join("volumes/data");
    assert_eq!(
        e.args,
        [
            "--name=t-etcd-0".to_string(),
            format!("--data-dir={}/data", data.display()),
            format!("--listen-client-urls=http://0.0.0.0:{client}"),
            format!("--advertise-client-urls=http://127.0.0.1:{client}"),
            format!("--initial-cluster=t-etcd-0=http://127.0.0.1:{peer}"),
            "--initial-cluster-token=t-etcd".to_string(),
        ]
    );
    // A Service reaches the first ready replica behind it.
    let svc = net.services.iter().find(|s| s.name == "t-node").unwrap();
    let ready: HashSet<String> = ["t-node-1".to_string()].into();
    assert_eq!(net.service_port(svc, 80, &ready), Ok(http_port));
}

#[test]
fn machinery_fails_on_what_it_cannot_resolve() {
    let (_dir, mut net) = small_net();
    let node = net.pods.iter_mut().find(|p| p.name == "t-node-0").unwrap();
    let c = &mut node.spec["containers"][0];
    c["env"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}));
    let err = small_plan(&net, "t-node-0").unwrap_err();
    assert!(err.contains("spec.nodeName"), "{err}");

    let cases = [
        (
            json!({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "MISSING"}}}),
            "MISSING",
        ),
        (json!({"name": "X", "value": "$(UNDEFINED)"}), "UNDEFINED"),
        (
            json!({"name": "X", "value": "http://t-etcd:9999"}),
            "no port 9999",
        ),
        (
            json!({"name": "X", "value": "http://t-etcd-0.t-etcd:1234"}),
            "no containerPort 1234",
        ),
    ];
    for (entry, needle) in cases {
        let node = net.pods.iter_mut().find(|p| p.name == "t-node-0").unwrap();
        node.spec["containers"][0]["env"] = json!([entry]);
        let err = small_plan(&net, "t-node-0").unwrap_err();
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let node = net.pods.iter_mut().find(|p| p.name == "t-node-0").unwrap();
    node.spec["containers"][0]["env"] = json!([]);
    node.spec["containers"][0]["readinessProbe"] =
        json!({"httpGet": {"path": "/health", "port": "grpc"}});
    let err = small_plan(&net, "t-node-0").unwrap_err();
    assert!(err.contains("no containerPort \"grpc\""), "{err}");
    // Data directories must be on a volume where the root is read-only
    // (and get scratch space where it is not).
    let node = net.pods.iter_mut().find(|p| p.name == "t-node-0").unwrap();
    node.spec["containers"][0]["readinessProbe"] = json!(null);
    node.spec["containers"][0]["args"] = json!(["decode", "--cache-dir", "/data/models"]);
    let l = small_plan(&net, "t-node-0").unwrap();
    let dir = net.pod("t-node-0").dir.join("cache-dir");
    assert_eq!(l.args, ["decode", "--cache-dir", dir.to_str().unwrap()]);
    let node = net.pods.iter_mut().find(|p| p.name == "t-node-0").unwrap();
    node.spec["containers"][0]["securityContext"] = json!({"readOnlyRootFilesystem": true});
    let err = small_plan(&net, "t-node-0").unwrap_err();
    assert!(
        err.contains("--cache-dir /data/models is on no volume"),
        "{err}"
    );
    node_command(&mut net, json!(["sh", "-c", "tandem router"]));
    let err = small_plan(&net, "t-node-0").unwrap_err();
    assert!(err.contains("command sh has no local equivalent"), "{err}");
}

fn node_command(net: &mut Net, cmd: Value) {
    let node = net.pods.iter_mut().find(|p| p.name == "t-node-0").unwrap();
    node.spec["containers"][0]["command"] = cmd;
}

#[test]
fn machinery_validates_against_the_binary_help() {
    let mut docs = parse_documents(SMALL).unwrap();
    assert_eq!(check_against_binary(&docs), Vec::<String>::new());
    fn spec(docs: &mut [Value]) -> &mut Value {
        let node = docs.iter().position(|d| d["kind"] == json!("Deployment"));
        &mut docs[node.unwrap()]["spec"]["template"]["spec"]["containers"][0]
    }
    // `--port` is a flag, `--por` and `--host-name` are not (whole words
    // only), nor `--tp`, a node's flag, for a router.
    spec(&mut docs)["args"] = json!([
        "router",
        "--por=1",
        "--host-name",
        "x",
        "-q",
        "--etcd",
        "http://x:1",
        "--tp",
        "1",
        "-h"
    ]);
    spec(&mut docs)["env"] =
        json!([{"name": "TANDEM_LOG", "value": "info"}, {"name": "TANDEM_PORTS", "value": "1"}]);
    // ConfigMap cfg as TANDEM_CLUSTER (a router's) and TANDEM_KEY (nobody's).
    spec(&mut docs)["envFrom"] = json!([{"configMapRef": {"name": "cfg"}, "prefix": "TANDEM_"}]);
    let problems = check_against_binary(&docs);
    assert_eq!(problems.len(), 6, "{problems:#?}");
    for needle in [
        "--por",
        "--host-name",
        "-q",
        "--tp",
        "TANDEM_PORTS",
        "TANDEM_KEY",
    ] {
        assert!(
            problems.iter().any(|p| p.ends_with(needle)),
            "{needle}: {problems:#?}"
        );
    }
    spec(&mut docs)["args"] = json!(["routr"]);
    let problems = check_against_binary(&docs);
    assert!(
        problems[0].contains("`tandem routr` is refused"),
        "{problems:#?}"
    );
}

/// A server answering every request with `status`, for probe checks.
fn answering(status: &'static str) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming().take(1) {
            let mut s = s.unwrap();
            // Read the whole request head first: closing with unread bytes
            // would reset the connection before the client reads the answer.
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(
                s,
                "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    port
}

#[test]
fn machinery_probe_outcomes() {
    let probe = |port| {
        check(&Check::Http {
            port,
            path: "/health".into(),
        })
    };
    assert_eq!(probe(answering("200 OK")), Outcome::Pass);
    assert!(matches!(
        probe(answering("503 Service Unavailable")),
        Outcome::NotYet(_)
    ));
    assert!(matches!(probe(answering("404 Not Found")), Outcome::Fatal(w) if w.contains("404")));
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    assert!(matches!(probe(closed), Outcome::NotYet(_)));
    assert!(matches!(
        check(&Check::Tcp { port: closed }),
        Outcome::NotYet(_)
    ));
    assert_eq!(check(&Check::Exec(vec!["true".into()])), Outcome::Pass);
    assert!(matches!(
        check(&Check::Exec(vec!["false".into()])),
        Outcome::NotYet(_)
    ));
}
