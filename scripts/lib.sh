# Shared by the project's scripts (sourced, not run).

log() { printf '\n== %s\n' "$*" >&2; }

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
