#!/usr/bin/env bash
# Sets up what tests/tests/container.rs needs to build and run the image of
# deploy/docker/Dockerfile here, each part only when missing:
#   - podman, buildah, runc, netavark + aardvark-dns (container networks
#     with DNS names) and iptables (netavark's firewall driver runs it: a
#     machine without it fails every networked container, an image build's
#     RUN steps included, with "netavark: No such file or directory"),
#     debootstrap, binutils (objcopy: the test strips the binary's debug
#     info as the Dockerfile's own build leaves it out): Debian packages
#     only;
#   - the base image localhost/debian:bookworm-slim (the Dockerfile's
#     RUNTIME_IMAGE, which no registry serves to these machines): Debian
#     bookworm from `debootstrap --variant=minbase` off the Debian mirror,
#     slimmed as the official debian:bookworm-slim is (no docs, man pages
#     or locales; apt keeps no .debs), cached as a tarball under
#     $TANDEM_CACHE/container/ and imported into podman's image store only
#     when podman lacks it.
# Then it runs one container (`true`) to prove the engine works here.
#
# Re-running it changes nothing and needs no network. Prints the state
# directory on its last line. Where no engine can be installed or run (not
# root, no apt-get, the packages do not install, a container does not
# start) it writes the reason to $TANDEM_CACHE/container/unavailable and
# exits 0: the tests then skip with that reason. Any other failure is an
# error (exit 1).
#
# scripts/test.sh runs it in the background while the workspace builds
# (cold: about 25 s of packages, 55 s of debootstrap; warm: under 2 s).
set -euo pipefail

TANDEM_CACHE=${TANDEM_CACHE:-$HOME/.cache/tandem}
state=$TANDEM_CACHE/container
mirror=${TANDEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${TANDEM_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
suite=bookworm
image=localhost/debian:bookworm-slim
# Bumped whenever the way the base is made changes: the tarball's name and
# the image's label carry it, so an old one is remade and re-imported.
recipe=1
tarball=$state/debian-$suite-slim.v$recipe.tar
mkdir -p "$state"
log() { printf '== container-tools: %s\n' "$*" >&2; }

unavailable() {
  log "no container engine here: $*"
  printf '%s\n' "$*" >"$state/unavailable"
  echo "$state"
  exit 0
}

# apt_locked ARGS...: apt-get ARGS, waiting (up to 10 minutes) while
# another script of the test run holds apt's locks: dpkg's through apt's
# own timeout, the package lists' by trying again.
apt_locked() {
  local err tries=0
  err=$(mktemp)
  until apt-get -o DPkg::Lock::Timeout=600 "$@" >/dev/null 2>"$err"; do
    if ! grep -q 'Could not get lock' "$err" || ((++tries > 120)); then
      cat "$err" >&2
      rm -f "$err"
      return 1
    fi
    sleep 5
  done
  rm -f "$err"
}

# ---------------------------------------------------------------- packages
# Root's podman: its image store (/var/lib/containers/storage) persists
# across runs, so a warm run rebuilds only the image's last layer.
[ "$(id -u)" -eq 0 ] || unavailable "the container tests run podman as root; this is uid $(id -u)"
packages=(podman buildah runc netavark aardvark-dns iptables debootstrap binutils)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  command -v apt-get >/dev/null || unavailable "no apt-get to install ${missing[*]} (Debian packages)"
  log "installing ${missing[*]} (apt)"
  apt_locked update -qq || unavailable "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt_locked install -y -qq "${missing[@]}" \
    || unavailable "apt-get install ${missing[*]} failed"
fi

# ---------------------------------------------------------------- base image
# slim ROOTFS: what debuerreotype's --slimify does for the official -slim
# images: dpkg leaves out docs, man pages and locales from now on (also in
# the Dockerfile's apt-get installs), and what minbase installed is removed.
slim() {
  local root=$1
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
  echo 'Acquire::GzipIndexes "true";' >"$root/etc/apt/apt.conf.d/docker-gzip-indexes"
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/{groff,info,linda,lintian,locale,man}/* \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
    "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/*
  # Each container gets these from the engine.
  : >"$root/etc/hostname"
  : >"$root/etc/resolv.conf"
}

if [ ! -f "$tarball" ]; then
  work=$(mktemp -d "$state/debootstrap.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  log "debootstrap --variant=minbase $suite from $mirror (about a minute)"
  debootstrap --variant=minbase "$suite" "$work/root" "$mirror" >"$work/log" 2>&1 || {
    tail -n 20 "$work/log" >&2
    echo "error: debootstrap failed (log above)" >&2
    exit 1
  }
  slim "$work/root"
  tar --numeric-owner --xattrs -C "$work/root" -cf "$work/base.tar" .
  mv "$work/base.tar" "$tarball"
  rm -rf "$work"
  trap - EXIT
  # Older recipes' tarballs.
  find "$state" -maxdepth 1 -name "debian-$suite-slim.v*.tar" -not -name "${tarball##*/}" -delete
fi

label() { podman image inspect --format '{{index .Labels "org.tandem.base-recipe"}}' "$image" 2>/dev/null; }
if [ "$(label)" != "$recipe" ]; then
  log "importing $tarball as $image"
  podman import --quiet \
    --change "LABEL org.tandem.base-recipe=$recipe" \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase $suite, slimmed (scripts/container-tools.sh)" \
    "$tarball" "$image" >/dev/null
fi

# ---------------------------------------------------------------- smoke run
# runc: crun refuses these VMs' hybrid cgroup layout. Limits no higher than
# this shell's hard ones (podman's defaults are higher, and the VM lets no
# process raise its limits), nproc also no higher than pid_max (more
# processes cannot exist; a higher nproc is refused here).
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu)
pid_max=$(cat /proc/sys/kernel/pid_max)
if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
ulimits=(--ulimit "nproc=$nproc:$nproc")
[ "$nofile" = unlimited ] || ulimits+=(--ulimit "nofile=$nofile:$nofile")
if ! out=$(podman --runtime runc run --rm --network none "${ulimits[@]}" "$image" true 2>&1); then
  unavailable "podman installed, but a container does not run: $out"
fi
rm -f "$state/unavailable"
echo "$state"
