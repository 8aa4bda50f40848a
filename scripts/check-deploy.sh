#!/usr/bin/env bash
# Static checks of the deployment files (no cluster, no Docker engine needed):
# for every values file in deploy/helm/values/, `helm lint --strict` and
# `helm template | kubernetes-validate --strict`, also with the
# ServiceMonitor/PodMonitor enabled; values the chart must refuse; the
# chart README's values table against values.yaml; hadolint on the
# Dockerfile. Installs its tools first (scripts/deploy-tools.sh; offline once
# they are there). One PASS/FAIL line per check; exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."

scripts/deploy-tools.sh || { echo "FAIL installing the tools (scripts/deploy-tools.sh)"; exit 1; }
TANDEM_TOOLS=${TANDEM_TOOLS:-$HOME/.cache/tandem/tools}
helm=$TANDEM_TOOLS/bin/helm
kv=$TANDEM_TOOLS/bin/kubernetes-validate
hadolint=$TANDEM_TOOLS/bin/hadolint
py=$TANDEM_TOOLS/venv/bin/python

chart=deploy/helm/tandem
# The chart needs >= 1.30 (native preStop sleep); validate against the
# Kubernetes release whose kubectl ships with our helm.
kube=1.33
release=tandem
passed=0
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# check NAME CMD...: runs CMD, prints PASS/FAIL NAME, and its output on failure.
check() {
  local name=$1
  shift
  if "$@" >"$tmp/out" 2>&1; then
    echo "PASS $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name"
    sed 's/^/    /' "$tmp/out"
    failed=$((failed + 1))
  fi
}

render() { "$helm" template "$release" "$chart" --kube-version "$kube.0" "$@"; }

# kubernetes-validate only warns (exit 0) on a kind it has no schema for, so
# any WARN or ERROR line fails here.
validate() {
  local out
  out=$("$kv" --strict --kubernetes-version "$kube" --quiet "$1" 2>&1)
  local rc=$?
  [ -n "$out" ] && echo "$out"
  [ "$rc" -eq 0 ] && ! grep -qE '^(WARN|ERROR|FATAL)' <<<"$out"
}

render_validate() { # FILE [helm flags...]
  local f=$1
  shift
  render -f "$f" "$@" >"$tmp/rendered.yaml" && validate "$tmp/rendered.yaml"
}

# With the monitors on: the built-in kinds are validated as above; the
# Prometheus Operator kinds have no schema offline (kubernetes-validate
# carries none for CRDs), so they are checked for what breaks silently in a
# cluster instead: each selects something this release renders, on a port
# name that exists there.
render_monitors() { # FILE
  render -f "$1" --set metrics.serviceMonitor.enabled=true --set metrics.podMonitor.enabled=true \
    >"$tmp/monitors.yaml" || return 1
  "$py" - "$tmp/monitors.yaml" "$tmp/builtin.yaml" <<'EOF' || return 1
import sys, yaml

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
builtin = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
monitors = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
yaml.safe_dump_all(builtin, open(sys.argv[2], "w"))

def selects(selector, labels):
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True

errors = []
if not monitors:
    errors.append("no ServiceMonitor or PodMonitor rendered")
for m in monitors:
    name = f'{m["kind"]}/{m["metadata"]["name"]}'
    sel = m["spec"]["selector"]
    if m["kind"] == "ServiceMonitor":
        targets = [d for d in docs if d["kind"] == "Service" and selects(sel, d["metadata"]["labels"])]
        ports = [{p["name"] for p in t["spec"]["ports"]} for t in targets]
        wanted = [e["port"] for e in m["spec"]["endpoints"]]
    elif m["kind"] == "PodMonitor":
        targets = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                   and selects(sel, d["spec"]["template"]["metadata"]["labels"])]
        ports = [{p["name"] for c in t["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
                 for t in targets]
        wanted = [e["port"] for e in m["spec"]["podMetricsEndpoints"]]
    else:
        errors.append(f"{name}: unexpected kind")
        continue
    if not targets:
        errors.append(f"{name}: selects nothing")
    for t, names in zip(targets, ports):
        for w in wanted:
            if w not in names:
                errors.append(f'{name}: {t["kind"]}/{t["metadata"]["name"]} has no port named {w}')
    print(f"{name}: selects {', '.join(t['kind'] + '/' + t['metadata']['name'] for t in targets)}")
if errors:
    print("\n".join(errors))
    sys.exit(1)
EOF
  validate "$tmp/builtin.yaml"
}

# A GPU role gets its nvidia.com/gpu limit and the driver capabilities its
# Vulkan path needs; a CPU role gets neither.
gpu_pods() {
  render -f "$chart/values.yaml" --set decode.devices=gpu:0 >"$tmp/gpu.yaml" || return 1
  "$py" - "$tmp/gpu.yaml" <<'EOF'
import sys, yaml

errors = []
for d in yaml.safe_load_all(open(sys.argv[1])):
    if not d or d["kind"] != "Deployment":
        continue
    c = d["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    caps = env.get("NVIDIA_DRIVER_CAPABILITIES") or ""
    gpu_role = c["name"] == "decode"
    if gpu_role and (gpus != 1 or "graphics" not in caps.split(",")):
        errors.append(f"{c['name']}: nvidia.com/gpu {gpus}, NVIDIA_DRIVER_CAPABILITIES {caps!r}")
    if not gpu_role and (gpus or caps):
        errors.append(f"{c['name']} (cpu): nvidia.com/gpu {gpus}, NVIDIA_DRIVER_CAPABILITIES {caps!r}")
print("\n".join(errors) or "decode on gpu:0: one GPU and the graphics capability; other roles neither")
sys.exit(1 if errors else 0)
EOF
}

# Values the chart must refuse at render time (schema or template checks).
must_fail() { # [helm flags...]
  if render "$@" >"$tmp/refused" 2>&1; then
    echo "rendered, but should have been refused"
    return 1
  fi
  grep -m1 -iE 'error' "$tmp/refused"
}

# Every key of values.yaml has a row in the README's values table (rows may
# group roles as `{router,serve}.key`), and every row names a real key.
# Free-form maps (resources, probes, security contexts) are one row each.
readme_table() {
  "$py" - "$chart/values.yaml" "$chart/README.md" <<'EOF'
import re, sys, yaml

OPAQUE = {"resources", "probes", "podSecurityContext", "securityContext"}

def leaves(node, prefix=""):
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k not in OPAQUE:
            yield from leaves(v, key + ".")
        else:
            yield key

def expand(row):
    m = re.search(r"\{([^}]*)\}", row)
    if not m:
        return [row]
    return [x for alt in m.group(1).split(",")
            for x in expand(row[:m.start()] + alt.strip() + row[m.end():])]

keys = set(leaves(yaml.safe_load(open(sys.argv[1]))))
rows = set()
for line in open(sys.argv[2]):
    m = re.match(r"^\|\s*`([^`]+)`\s*\|", line)
    if m:
        rows.update(expand(m.group(1)))
missing = sorted(keys - rows)
stale = sorted(rows - keys)
for k in missing:
    print(f"values.yaml key without a README row: {k}")
for k in stale:
    print(f"README row for a key values.yaml does not have: {k}")
print(f"{len(keys)} keys, {len(rows)} rows")
sys.exit(1 if missing or stale else 0)
EOF
}

shopt -s nullglob
values=(deploy/helm/values/*.yaml)
for required in aggregated 1p1d hetero-tp3; do
  [ -f "deploy/helm/values/$required.yaml" ] || {
    echo "FAIL deploy/helm/values/$required.yaml is missing"
    failed=$((failed + 1))
  }
done

check "helm lint --strict (chart defaults)" "$helm" lint --strict "$chart"
check "helm template | kubernetes-validate --strict -k $kube (chart defaults)" \
  render_validate "$chart/values.yaml"
for f in "${values[@]}"; do
  name=$(basename "$f" .yaml)
  check "helm lint --strict ($name)" "$helm" lint --strict "$chart" -f "$f"
  check "helm template | kubernetes-validate --strict -k $kube ($name)" render_validate "$f"
  check "with ServiceMonitor/PodMonitor: built-in kinds validated, monitors' selectors and ports checked ($name)" \
    render_monitors "$f"
done
# TLS material and API keys from Secrets (the secrets themselves are the
# operator's, e.g. cert-manager's): both modes render and validate.
for mode in disaggregated aggregated; do
  check "helm template | kubernetes-validate --strict -k $kube (TLS and API keys from Secrets, $mode)" \
    render_validate "$chart/values.yaml" --set mode=$mode --set tls.cluster.secretName=tandem-cluster-tls \
    --set tls.http.secretName=tandem-https --set apiKeys.secretName=tandem-api-keys
done
# etcd's client-certificate authentication off, and an external etcd whose
# client certificate comes from the operator's Secret.
check "helm template | kubernetes-validate --strict -k $kube (in-chart etcd without client-certificate auth)" \
  render_validate "$chart/values.yaml" --set etcd.auth.enabled=false
check "helm template | kubernetes-validate --strict -k $kube (external etcd, client certificate from a Secret)" \
  render_validate "$chart/values.yaml" --set etcd.enabled=false \
  --set 'etcd.endpoints={https://etcd.example:2379}' --set etcd.auth.secretName=etcd-client
echo "NOTE ServiceMonitor/PodMonitor (monitoring.coreos.com/v1) are not schema-validated: kubernetes-validate has no CRD schemas offline"

check "a GPU decode role: nvidia.com/gpu and NVIDIA_DRIVER_CAPABILITIES with graphics" gpu_pods
check "refused: unknown mode" must_fail --set mode=bogus
check "refused: disaggregated without etcd" must_fail --set etcd.enabled=false
check "refused: unknown value key (schema)" must_fail --set router.tp=2
check "refused: grace period shorter than preStop + drain" must_fail --set decode.terminationGracePeriodSeconds=20
check "refused: --devices and --tp disagree" must_fail --set prefill.tp=3 --set prefill.devices=cpu:2
check "refused: persistentVolumeClaim cache without a claim" must_fail --set model.cache.type=persistentVolumeClaim
check "refused: an invalid Secret name" must_fail --set tls.cluster.secretName=Not_A_Name
check "chart README values table covers values.yaml" readme_table
check "hadolint deploy/docker/Dockerfile" "$hadolint" --no-color deploy/docker/Dockerfile

echo "check-deploy: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
