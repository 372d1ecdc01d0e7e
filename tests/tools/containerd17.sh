#!/bin/sh
# Fetch containerd 1.7 (Debian 13's package: it applies CDI; Debian 12's 1.6 does not), once per
# machine, for the Kubernetes end-to-end test of CDI answers on containerd, and print the directory
# holding its programs (containerd, ctr, the runc shims).
#   containerd17.sh [CACHE_DIR]   default: $CONTAINERD17_CACHE, else /var/cache/oci-gpu-hook-containerd17
# Needs: curl, dpkg-deb, sha256sum; 33 MB of download, 120 MB in the cache. Nothing is installed:
# the package is unpacked into the cache only. The .deb is checked against the SHA256 pinned here
# (that of the package as deb.debian.org served it when pinned): a mirror serving anything else
# fails the fetch. The mirror is the one apt uses here (/etc/apt/sources.list.d/debian.sources).
set -eu
cache=${1:-${CONTAINERD17_CACHE:-/var/cache/oci-gpu-hook-containerd17}}
version="1.7.24~ds1-6+deb13u1"
sha256="ed708deb96fe476a3bce4efa5c0538dfbcf717ab9a7c7944ba7260342c25899c"
bin="$cache/$version/usr/bin"
if [ -x "$bin/containerd" ] && [ -x "$bin/containerd-shim-runc-v2" ]; then echo "$bin"; exit 0; fi
mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
mirror=${mirror:-http://deb.debian.org/debian}
mkdir -p "$cache"
work=$(mktemp -d "$cache/fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT
deb="$work/containerd.deb"
curl -fsS --retry 3 -o "$deb" "$mirror/pool/main/c/containerd/containerd_${version}_amd64.deb" >&2
echo "$sha256  $deb" | sha256sum -c --quiet - >&2
dpkg-deb -x "$deb" "$work/root"
"$work/root/usr/bin/containerd" --version >&2
rm -rf "${cache:?}/$version"
mv "$work/root" "$cache/$version"
echo "$bin"
