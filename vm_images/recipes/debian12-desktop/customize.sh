#!/bin/sh
# deskvm recipe customization, run as root inside the new root filesystem (chroot) after all
# packages are installed and rootfs/ has been copied over it.
set -eu

echo deskvm >/etc/hostname
cat >/etc/hosts <<'HOSTS'
127.0.0.1	localhost
127.0.1.1	deskvm
::1		localhost ip6-localhost ip6-loopback
HOSTS
# Whole-disk ext4 on virtio-blk; the base is fresh for every session, so no fsck.
echo '/dev/vda / ext4 rw,noatime,errors=remount-ro 0 0' >/etc/fstab

# The desktop user: uid 1000, locked password, no sudo, no extra groups.
useradd --create-home --uid 1000 --user-group --shell /bin/bash --comment 'deskvm desktop' desk
passwd --lock desk >/dev/null

chmod 0755 /usr/local/lib/deskvm/session /usr/local/lib/deskvm/desktop \
    /usr/local/bin/deskvm-input-probe /usr/local/bin/deskvm-helper /etc/initramfs-tools/hooks/deskvm

# A fixed machine id: no "first boot" (which would re-run presets) in any session.
od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >/etc/machine-id
echo >>/etc/machine-id

systemctl set-default multi-user.target
systemctl enable deskvm-session.service
# Networking starts from udev only when a NIC exists (rules.d/80-deskvm.rules).
systemctl disable systemd-networkd.service systemd-networkd.socket systemd-resolved.service \
    2>/dev/null || true
# Nothing that slows boot or runs later on its own.
systemctl mask \
    apt-daily.timer apt-daily-upgrade.timer man-db.timer e2scrub_all.timer \
    e2scrub_reap.service fstrim.timer dpkg-db-backup.timer logrotate.timer \
    getty@tty1.service serial-getty@ttyS0.service serial-getty@ttyS1.service \
    systemd-networkd-wait-online.service systemd-firstboot.service \
    systemd-hwdb-update.service ldconfig.service keyboard-setup.service \
    console-setup.service systemd-timesyncd.service systemd-pstore.service \
    systemd-modules-load.service systemd-binfmt.service proc-sys-fs-binfmt_misc.automount \
    modprobe@dm_mod.service modprobe@loop.service modprobe@fuse.service \
    modprobe@efi_pstore.service modprobe@configfs.service sys-kernel-config.mount \
    sys-kernel-debug.mount sys-kernel-tracing.mount sys-fs-fuse-connections.mount \
    >/dev/null
# The session runs without PAM/logind (setpriv); D-Bus stays socket-activated on demand.
systemctl mask systemd-logind.service >/dev/null

# Caches the first boot would otherwise build.
systemd-hwdb update
ldconfig
fc-cache -s >/dev/null 2>&1 || true
touch /etc/.updated /var/.updated

# The initrd must carry virtio-blk and ext4 (root=/dev/vda, no partition table).
kver=$(ls /lib/modules | sort -V | tail -n 1)
for module in virtio_blk ext4; do
    if ! grep -q "/$module.ko" "/lib/modules/$kver/modules.builtin" &&
        ! lsinitramfs "/boot/initrd.img-$kver" | grep -q "/$module.ko"; then
        echo "customize: $module missing from initrd" >&2
        exit 1
    fi
done
command -v cvt >/dev/null || { echo "customize: cvt missing" >&2; exit 1; }
