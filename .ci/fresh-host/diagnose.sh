#!/bin/sh
# Runs as root inside a fresh-host container after the README's commands (so it cannot
# change their outcome): what this container lets a sandbox use, and, step by step, where
# bubblewrap and unshare(1) stop. Every line is "name: exit N: last stderr line".
# Argument: the checkout directory (for `devs-sandbox doctor` from its venv).
src=${1:-.}

echo "== container"
id
grep -E '^(CapEff|CapBnd|Seccomp|NoNewPrivs):' /proc/self/status
for f in /proc/sys/kernel/unprivileged_userns_clone /proc/sys/user/max_user_namespaces \
         /proc/sys/kernel/apparmor_restrict_unprivileged_userns; do
    [ -r "$f" ] && echo "$f = $(cat "$f")"
done
echo "masked /proc paths (mounts over /proc/*):"
awk '$5 ~ "^/proc/." { print "  " $5 " (" $9 ", " $6 ")" }' /proc/self/mountinfo

try() {
    name=$1
    shift
    err=$("$@" 2>&1 >/dev/null)
    rc=$?
    last=$(printf '%s\n' "$err" | tail -n 1)
    echo "$name: exit $rc${last:+: $last}"
}

echo "== unshare(1) (util-linux, in every Debian)"
try "unshare pid+mount, --mount-proc" unshare --pid --mount --fork --mount-proc /bin/true
try "unshare net" unshare --net /bin/true
try "unshare ipc+uts" unshare --ipc --uts /bin/true
try "unshare user (map root)" unshare --user --map-root-user /bin/true
try "unshare all, mount proc by hand" unshare --pid --mount --net --ipc --uts --fork \
    sh -c 'mount --make-rprivate / && mount -t proc proc /proc'
try "unshare all, tmpfs on /tmp" unshare --mount --fork \
    sh -c 'mount --make-rprivate / && mount -t tmpfs tmpfs /tmp'

echo "== bwrap, one feature at a time (as root)"
if command -v bwrap >/dev/null 2>&1; then
    bwrap --version
    try "bwrap bind / only" bwrap --ro-bind / / /bin/true
    try "bwrap + unshare-pid" bwrap --unshare-pid --ro-bind / / /bin/true
    try "bwrap + unshare-net" bwrap --unshare-net --ro-bind / / /bin/true
    try "bwrap + unshare-ipc,uts" bwrap --unshare-ipc --unshare-uts --ro-bind / / /bin/true
    try "bwrap + --dev /dev" bwrap --ro-bind / / --dev /dev /bin/true
    try "bwrap + --tmpfs /tmp" bwrap --ro-bind / / --tmpfs /tmp /bin/true
    try "bwrap + --proc /proc (no pid ns)" bwrap --ro-bind / / --proc /proc /bin/true
    try "bwrap + unshare-pid + --proc /proc" bwrap --unshare-pid --ro-bind / / --proc /proc /bin/true
    try "bwrap + unshare-pid + --bind /proc /proc" bwrap --unshare-pid --ro-bind / / --bind /proc /proc /bin/true
    try "bwrap, the driver's probe" bwrap --cap-drop ALL --unshare-pid --unshare-net --unshare-ipc \
        --unshare-uts --die-with-parent --ro-bind / / --proc /proc --dev /dev --tmpfs /tmp -- /bin/true
    try "bwrap, the driver's probe as uid 1600000000" setpriv --reuid=1600000000 --regid=1600000000 \
        --clear-groups --no-new-privs -- bwrap --unshare-pid --unshare-net --unshare-ipc \
        --unshare-uts --die-with-parent --ro-bind / / --proc /proc --dev /dev --tmpfs /tmp -- /bin/true
else
    echo "bwrap not installed"
fi

echo "== devs-sandbox doctor (from the checkout's venv)"
if [ -x "$src/.venv/bin/devs-sandbox" ]; then
    "$src/.venv/bin/devs-sandbox" doctor 2>&1
    echo "doctor: exit $?"
else
    echo "no $src/.venv/bin/devs-sandbox"
fi
