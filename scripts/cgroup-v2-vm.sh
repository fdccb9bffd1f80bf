#!/usr/bin/env bash
# Runs a command inside a virtual machine (qemu) whose only cgroup hierarchy is v2, on this host's own
# files: the spawner's cgroup v2 path checked against a real kernel on a host that has v1 controllers.
#
#   scripts/cgroup-v2-vm.sh [COMMAND...]      default: the spawner's cgroup and escape tests (long
#                                             when emulated: name a few tests instead)
#   L4M_VM_NESTED_NS=1 scripts/cgroup-v2-vm.sh ...   COMMAND runs in a cgroup namespace whose root holds
#                                             processes, as in a privileged container
#
# Needs root, qemu-system-x86 and a Debian kernel (linux-image-amd64), and busybox-static for
# the initramfs; it installs the packages it lacks. The machine (2 vCPUs, 6 GiB) sees this host's root
# read-only through 9p under a throwaway writable layer (overlayfs on tmpfs), mounts cgroup2 at
# /sys/fs/cgroup (cgroup_no_v1=all), runs COMMAND from the repository root and powers off. Its console
# goes to stdout; the exit status is COMMAND's. Nothing it writes reaches this host but the output
# directory (a temporary one, printed).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "cgroup-v2-vm: needs root" >&2; exit 2; }
missing=()
command -v qemu-system-x86_64 > /dev/null || missing+=(qemu-system-x86)
[ -x /usr/bin/busybox ] && /usr/bin/busybox --list | grep -qx switch_root || missing+=(busybox-static)
compgen -G "/boot/vmlinuz-*" > /dev/null || missing+=(linux-image-amd64)
if [ ${#missing[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null
fi
kernel=$(ls /boot/vmlinuz-* | sort -V | tail -1)
# Emulated by default (TCG): on the 2-core development host a KVM guest hangs before the kernel's first
# line (nested virtualisation); L4M_VM_ACCEL=kvm where it works. Emulation is ~10-20x slower, so the
# tests stretch their time limits (L4M_TEST_SLOWDOWN).
accel=${L4M_VM_ACCEL:-tcg}
slowdown=$([ "$accel" = tcg ] && echo 15 || echo 1)
release=${kernel#/boot/vmlinuz-}

work=$(mktemp -d /tmp/l4m-cgroup-v2-vm.XXXXXX)
out=$work/out
mkdir -p "$work/initramfs"/{bin,dev,proc,sys,newroot,lower,upper,modules} "$out"
cp /usr/bin/busybox "$work/initramfs/bin/busybox"
# The modules for a 9p root on virtio-pci, and overlayfs, in dependency order.
for module in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci netfs fscache \
  9pnet 9pnet_virtio 9p overlay; do
  file=$(modinfo -k "$release" -n "$module" 2> /dev/null || true)
  [ -n "$file" ] && [ "$file" != "(builtin)" ] && cp "$file" "$work/initramfs/modules/$module.ko"
  echo "$module" >> "$work/initramfs/modules/order"
done
cat > "$work/initramfs/init" << 'EOF'
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for module in $(/bin/busybox cat /modules/order); do
  [ -f /modules/$module.ko ] && /bin/busybox insmod /modules/$module.ko
done
opts=trans=virtio,version=9p2000.L,msize=1048576,cache=loose
/bin/busybox mount -t 9p -o ro,$opts hostroot /lower || { echo "no 9p root"; /bin/busybox poweroff -f; }
/bin/busybox mount -t tmpfs -o size=4g tmpfs /upper
/bin/busybox mkdir -p /upper/data /upper/work
/bin/busybox mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot
/bin/busybox mkdir -p /newroot/mnt/out
/bin/busybox mount -t 9p -o $opts out /newroot/mnt/out
/bin/busybox umount /proc /sys /dev
exec /bin/busybox switch_root /newroot /bin/sh /mnt/out/stage2.sh
EOF
chmod +x "$work/initramfs/init"
(cd "$work/initramfs" && find . | cpio -o -H newc --quiet | gzip -1) > "$work/initramfs.gz"

if [ $# -gt 0 ]; then
  printf '%q ' "$@" > "$out/command"
else
  echo ".venv/bin/pytest -p no:cacheprovider -q -k 'not docker' tests/unit/spawner/test_cgroups.py" \
    "tests/integration/spawner/test_cgroup_limits.py tests/integration/spawner/test_cleanup.py" \
    "tests/integration/spawner/test_escape.py" > "$out/command"
fi
cat > "$out/stage2.sh" << EOF
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /dev/shm
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs /run
ip link set lo up
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PYTHONDONTWRITEBYTECODE=1
export L4M_TEST_SLOWDOWN=${slowdown}
echo "[vm] kernel \$(uname -r); /sys/fs/cgroup: \$(cat /sys/fs/cgroup/cgroup.controllers)"
cd $root
if [ "${L4M_VM_NESTED_NS:-0}" = 1 ]; then
  # A privileged container's view: a cgroup namespace whose root is a non-root group holding processes.
  # The runtime gives the container's group the controllers, as Docker does.
  echo "+memory +pids +cpu" > /sys/fs/cgroup/cgroup.subtree_control
  mkdir /sys/fs/cgroup/container && echo \$\$ > /sys/fs/cgroup/container/cgroup.procs
  unshare --cgroup --mount --propagation private sh -c \
    'umount /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup && echo "[vm] in a cgroup namespace: \$(cat /proc/self/cgroup)" && exec sh -c "\$(cat /mnt/out/command)"'
else
  sh -c "\$(cat /mnt/out/command)"
fi
echo \$? > /mnt/out/status
sync
poweroff -f
EOF
echo "[cgroup-v2-vm] kernel $release; output in $out"
timeout "${L4M_VM_TIMEOUT_S:-1500}" qemu-system-x86_64 -accel "$accel" -cpu "${L4M_VM_CPU:-$([ "$accel" = tcg ] && echo max || echo host,-arch-capabilities)}" -smp 2 -m 6144 -nographic -no-reboot -net none \
  -kernel "$kernel" -initrd "$work/initramfs.gz" \
  -append "console=ttyS0 earlyprintk=serial,ttyS0,115200 ${L4M_VM_APPEND:-}cgroup_no_v1=all systemd.unified_cgroup_hierarchy=1 panic=-1" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$out",mount_tag=out,security_model=none \
  < /dev/null
status=$(cat "$out/status" 2> /dev/null || echo 125)
echo "[cgroup-v2-vm] exit status $status"
exit "$status"
