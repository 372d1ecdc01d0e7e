# proves: the hook's own labels where no runtime gives them: runc run directly (an OCI bundle, as CRI-O and containerd hand runc one) on a plain directory rootfs with no context= mount, linux.mountLabel set: the tmpfs the hook mounts itself (the graphics application profile directory; the /proc/driver/nvidia mask takes the same path, but no procfs here has that directory without a driver) carries the mount label through its context= option, so do the file it writes there and the ld cache it installs, and nothing of the host is relabelled; no denial
# timeout: 240
LABEL=system_u:object_r:container_file_t:s0:c7,c11
B=/var/tmp/vmcheck-bundle
runc delete -f vmcheck-tmpfs >/dev/null 2>&1
rm -rf "$B" && mkdir -p "$B/rootfs"
cid=$(podman create localhost/gpubox /bin/true) && podman export "$cid" | tar -xf - -C "$B/rootfs" && podman rm "$cid" >/dev/null \
    || fail "cannot unpack the image into a bundle"
chcon -R "$LABEL" "$B/rootfs"
stat -c %C "$SIM/dev/nvidia0" > /tmp/host-label.before
(cd "$B" && runc spec)
# the hook as install registered it for podman (hooks.d), now in the bundle as CRI-O would put it
python3 - "$B/config.json" "$LABEL" <<'PY' || fail "cannot write the bundle's config.json"
import glob, json, sys
path, label = sys.argv[1], sys.argv[2]
with open(path) as f:
    config = json.load(f)
found = glob.glob("/usr/share/containers/oci/hooks.d/*.json") + glob.glob("/etc/containers/oci/hooks.d/*.json")
hook = next(json.load(open(p))["hook"] for p in found if "oci-gpu-hook" in open(p).read())
config["hooks"] = {"prestart": [hook]}
config["process"]["terminal"] = False
config["process"]["args"] = ["/bin/busybox", "sleep", "100000"]
config["process"]["env"] += ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics"]
config["linux"]["mountLabel"] = label
config["root"]["readonly"] = False
json.dump(config, open(path, "w"))
PY
run runc run -d --bundle "$B" vmcheck-tmpfs </dev/null >/dev/null || fail "runc did not start the container"
pid=$(runc state vmcheck-tmpfs | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
R=/proc/$pid/root
D=/etc/nvidia/nvidia-application-profiles-rc.d
grep " $D tmpfs " "/proc/$pid/mounts" || { runc delete -f vmcheck-tmpfs; fail "the hook mounted no tmpfs at $D"; }
grep " $D tmpfs " "/proc/$pid/mounts" | grep -q "context=\"\?$LABEL" \
    || { runc delete -f vmcheck-tmpfs; fail "the hook's tmpfs has no context=$LABEL"; }
bad=0
# (the mount points under the hook's binds show the host file's own label: not looked at here)
for f in $R$D $R$D/* $R/etc/ld.so.cache; do
    [ -e "$f" ] || { echo "missing: ${f#$R}"; bad=1; continue; }
    got=$(stat -c %C "$f")
    echo "${f#$R} $got"
    [ "$got" = "$LABEL" ] || bad=1
done
runc delete -f vmcheck-tmpfs
[ "$bad" = 0 ] || fail "something the hook created does not carry the mount label $LABEL"
[ "$(stat -c %C "$SIM/dev/nvidia0")" = "$(cat /tmp/host-label.before)" ] || fail "the host's device node was relabelled"
rm -rf "$B" /tmp/host-label.before
no_denials "runc with the hook and linux.mountLabel"
