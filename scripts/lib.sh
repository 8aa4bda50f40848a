# Shared by the project's scripts (sourced, not run).

# Each step is stamped with the time since the script started, so a slow CI
# run shows where its minutes went.
log() { printf '\n== [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

# ensure_packages PKG...: installs the Debian packages that are missing
# (apt-get update first; sudo when not root).
ensure_packages() {
  local missing=() p sudo=""
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  log "installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

# ci_build_env: the one build configuration of the test command, exported
# so that every cargo command after it (and every developer shell that
# sources this) reuses the same artifacts. The target directory lives in
# the cache, not in the checkout, so a fresh clone on a machine that ran
# the tests before rebuilds only what changed. Clippy runs as the
# workspace crates' compiler (clippy-driver compiles as rustc does and
# lints on the way), and -D warnings makes every warning an error.
ci_build_env() {
  export TANDEM_CACHE=${TANDEM_CACHE:-$HOME/.cache/tandem}
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$TANDEM_CACHE/target}
  export RUSTC_WORKSPACE_WRAPPER
  RUSTC_WORKSPACE_WRAPPER=$(rustc --print sysroot)/bin/clippy-driver
  export RUSTFLAGS="-D warnings"
}
