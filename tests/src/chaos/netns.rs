//! Network namespaces for the chaos tests: one per process (etcd, router,
//! each node), each joined by a veth pair to a hub namespace that routes
//! between them, and the hub joined to the test's own (root) namespace.
//! Everything is in 198.18.K.0/24 (RFC 2544 benchmarking space), one K per
//! test run, so nothing leaves the machine.
//!
//! Faults: a pair partition is a pair of `blackhole` policy rules in the
//! hub (forwarded packets between the two addresses are dropped silently,
//! as on a cut link; both ends' other paths work); a whole link goes down
//! with `ip link set ... down`; bandwidth is a `tbf` qdisc on a
//! namespace's egress. Everything is removed on drop (also on panic), and
//! leftovers of runs whose process is gone are removed at start.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::{Mutex, PoisonError};

/// Prefix of every namespace and root interface this module makes.
const PREFIX: &str = "tch";

/// One namespace: where a process runs and the address it binds.
#[derive(Debug, Clone)]
pub struct Space {
    pub name: String,
    pub ip: Ipv4Addr,
    /// The namespace's interface (for `--ucx-net-devices`).
    pub dev: String,
    /// Its peer in the hub namespace.
    hub_dev: String,
}

impl Space {
    /// `ip netns exec NS`: put before a command line to run it here.
    pub fn exec_prefix(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.name]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }
}

/// The namespaces of one test run.
#[derive(Debug)]
pub struct Net {
    hub: String,
    root_dev: String,
    subnet: u8,
    spaces: Vec<Space>,
    /// Policy rules in force, as `ip rule` arguments.
    rules: Mutex<Vec<Vec<String>>>,
}

/// Runs `ip`/`tc`/`sysctl` and panics with its stderr if it fails: a
/// chaos test cannot run without its network, and must say so loudly.
pub fn sh(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

impl Net {
    /// Makes the hub and one namespace per name in `names`.
    pub fn new(names: &[&str]) -> Net {
        assert!(names.len() <= 30, "at most 30 namespaces");
        remove_stale();
        let pid = std::process::id();
        let subnet = free_subnet(pid);
        let hub = format!("{PREFIX}{pid}hub");
        let root_dev = format!("{PREFIX}{pid}r");
        let mut net = Net {
            hub: hub.clone(),
            root_dev: root_dev.clone(),
            subnet,
            spaces: Vec::new(),
            rules: Mutex::new(Vec::new()),
        };
        sh("ip", &["netns", "add", &hub]);
        sh("ip", &["-n", &hub, "link", "set", "lo", "up"]);
        sh(
            "ip",
            &[
                "netns",
                "exec",
                &hub,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
        );
        // Root <-> hub: hub .1, root .2 (the test's clients) and .3 (the
        // fault proxies), a /29.
        sh(
            "ip",
            &[
                "link", "add", "name", &root_dev, "type", "veth", "peer", "name", "up0", "netns",
                &hub,
            ],
        );
        let a = |host: u8, len: u8| format!("198.18.{subnet}.{host}/{len}");
        sh("ip", &["-n", &hub, "addr", "add", &a(1, 29), "dev", "up0"]);
        sh("ip", &["-n", &hub, "link", "set", "up0", "up"]);
        sh("ip", &["addr", "add", &a(2, 29), "dev", &root_dev]);
        sh("ip", &["addr", "add", &a(3, 29), "dev", &root_dev]);
        sh("ip", &["link", "set", &root_dev, "up"]);
        sh(
            "ip",
            &[
                "route",
                "add",
                &format!("198.18.{subnet}.0/24"),
                "via",
                &format!("198.18.{subnet}.1"),
                "dev",
                &root_dev,
            ],
        );
        for (i, name) in names.iter().enumerate() {
            let ns = format!("{PREFIX}{pid}{name}");
            assert!(ns.len() <= 15, "namespace name {ns} too long");
            let base = 8 * (i as u8 + 1);
            let hub_dev = format!("h{i}");
            sh("ip", &["netns", "add", &ns]);
            sh("ip", &["-n", &ns, "link", "set", "lo", "up"]);
            sh(
                "ip",
                &[
                    "-n", &hub, "link", "add", "name", &hub_dev, "type", "veth", "peer", "name",
                    "v0", "netns", &ns,
                ],
            );
            sh(
                "ip",
                &["-n", &hub, "addr", "add", &a(base + 1, 29), "dev", &hub_dev],
            );
            sh("ip", &["-n", &hub, "link", "set", &hub_dev, "up"]);
            sh(
                "ip",
                &["-n", &ns, "addr", "add", &a(base + 2, 29), "dev", "v0"],
            );
            sh("ip", &["-n", &ns, "link", "set", "v0", "up"]);
            sh(
                "ip",
                &[
                    "-n",
                    &ns,
                    "route",
                    "add",
                    "default",
                    "via",
                    &format!("198.18.{subnet}.{}", base + 1),
                ],
            );
            net.spaces.push(Space {
                name: ns,
                ip: Ipv4Addr::new(198, 18, subnet, base + 2),
                dev: "v0".into(),
                hub_dev,
            });
        }
        net
    }

    pub fn space(&self, name: &str) -> &Space {
        let full = format!("{PREFIX}{}{name}", std::process::id());
        self.spaces
            .iter()
            .find(|s| s.name == full)
            .unwrap_or_else(|| panic!("no namespace {name}"))
    }

    /// The root namespace's address on the hub link (the test's clients).
    pub fn root_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.subnet, 2)
    }

    /// The root namespace's second address, where fault proxies listen.
    pub fn proxy_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.subnet, 3)
    }

    /// Adds a blackhole rule for packets from `from` to `to` in the hub.
    fn blackhole(&self, from: Ipv4Addr, to: Ipv4Addr) {
        let args: Vec<String> = [
            "-n",
            &self.hub,
            "rule",
            "add",
            "from",
            &from.to_string(),
            "to",
            &to.to_string(),
            "blackhole",
            "priority",
            "100",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        sh("ip", &refs);
        self.rules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(args);
    }

    /// Drops every packet between `a` and `b`, both ways, silently.
    pub fn partition(&self, a: Ipv4Addr, b: Ipv4Addr) {
        self.blackhole(a, b);
        self.blackhole(b, a);
    }

    /// Removes every partition.
    pub fn heal_partitions(&self) {
        let rules = std::mem::take(&mut *self.rules.lock().unwrap_or_else(PoisonError::into_inner));
        for mut r in rules {
            r[3] = "del".into();
            let refs: Vec<&str> = r.iter().map(String::as_str).collect();
            sh("ip", &refs);
        }
    }

    /// Takes `space`'s link down at the hub (its end sees no carrier:
    /// packets to and from it vanish) or up again.
    pub fn set_link(&self, space: &Space, up: bool) {
        sh(
            "ip",
            &[
                "-n",
                &self.hub,
                "link",
                "set",
                &space.hub_dev,
                if up { "up" } else { "down" },
            ],
        );
    }

    /// Limits what `space` sends to `rate` (a tc rate, e.g. `10mbit`).
    pub fn throttle(&self, space: &Space, rate: &str) {
        sh(
            "ip",
            &[
                "netns",
                "exec",
                &space.name,
                "tc",
                "qdisc",
                "replace",
                "dev",
                &space.dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kbit",
                "latency",
                "500ms",
            ],
        );
    }

    pub fn unthrottle(&self, space: &Space) {
        sh(
            "ip",
            &[
                "netns",
                "exec",
                &space.name,
                "tc",
                "qdisc",
                "del",
                "dev",
                &space.dev,
                "root",
            ],
        );
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for s in &self.spaces {
            let _ = Command::new("ip").args(["netns", "del", &s.name]).output();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.hub])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_dev])
            .output();
    }
}

/// Checks that namespaces can be made here at all, with a clear message
/// when not (the chaos tests need root and `ip netns`).
pub fn require_netns() {
    let probe = format!("{PREFIX}{}probe", std::process::id());
    let out = Command::new("ip").args(["netns", "add", &probe]).output();
    match out {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).output();
        }
        Ok(o) => panic!(
            "the chaos tests need network namespaces (root, `ip netns add`): {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("the chaos tests need iproute2's `ip`: {e}"),
    }
}

/// A third octet no route of this machine uses yet.
fn free_subnet(pid: u32) -> u8 {
    let routes = output("ip", &["-4", "route", "show"]);
    (0..=255u32)
        .map(|i| ((pid + i) % 256) as u8)
        .find(|k| !routes.contains(&format!("198.18.{k}.")))
        .expect("a free 198.18.K.0/24")
}

/// Removes namespaces and root links of earlier runs whose process is gone
/// (a test killed by SIGKILL runs no destructor).
fn remove_stale() {
    let alive = |name: &str| -> bool {
        let digits: String = name[PREFIX.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.is_empty() || std::path::Path::new(&format!("/proc/{digits}")).exists()
    };
    for line in output("ip", &["netns", "list"]).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if name.starts_with(PREFIX) && !alive(name) {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
    for line in output("ip", &["-o", "link", "show"]).lines() {
        let Some(name) = line.split(": ").nth(1) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or("");
        if name.starts_with(PREFIX) && !alive(name) {
            let _ = Command::new("ip").args(["link", "del", name]).output();
        }
    }
}
