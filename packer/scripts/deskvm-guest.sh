#!/bin/sh
# deskvm guest contract on a system an installer made (run by the Packer templates as root,
# inside the VM being built). Applies what `deskvm image files RECIPE DIR --installed-system`
# wrote on the host and Packer uploaded to $DESKVM_FILES (default /tmp/deskvm-files):
#
#   packages.txt  the recipe's packages (Xorg, window manager, python3-tk, xdotool...);
#                 names this distribution lacks (Debian's linux-image-amd64 on Ubuntu) are
#                 skipped with a message, the kernel the installer set up stays
#   rootfs/       the guest files: deskvm-session.service, the session and desktop scripts,
#                 the guest helper (virtio-serial), the input probe, image.conf, keyboard
#   finalize.sh   user `desk` (uid 1000, autologin through deskvm-session.service), services
#
# then makes the image boot the way deskvm sessions expect: kernel console on ttyS0, no
# display manager (the deskvm session starts Xorg and the desktop itself and writes
# DESKVM_READY WxH on ttyS1), deskvm.* options read from SMBIOS OEM strings.
set -eu
files=${DESKVM_FILES:-/tmp/deskvm-files}
export DEBIAN_FRONTEND=noninteractive

[ -s "$files/packages.txt" ] || { echo "deskvm-guest: no $files/packages.txt" >&2; exit 1; }
apt-get update -q
install=
for package in $(cat "$files/packages.txt"); do
    if apt-cache show "$package" >/dev/null 2>&1; then
        install="$install $package"
    else
        echo "deskvm-guest: $package is not in this distribution's archive: skipped" >&2
    fi
done
# shellcheck disable=SC2086  # a list of package names
apt-get install -y -q --no-install-recommends $install

cp -a "$files/rootfs/." /
# The session's user is created by finalize.sh; an installer-made user with uid 1000
# (Ubuntu's autoinstall identity) is renamed away first.
if getent passwd 1000 >/dev/null && [ "$(getent passwd 1000 | cut -d: -f1)" != desk ]; then
    usermod --login deskvm-install --uid 1999 "$(getent passwd 1000 | cut -d: -f1)"
fi
sh -eu "$files/finalize.sh"

# No display manager: the deskvm session owns the display.
for dm in gdm3 gdm lightdm sddm; do
    systemctl disable "$dm.service" 2>/dev/null || true
done
systemctl set-default multi-user.target

# Kernel messages on the console port (ttyS0); quiet boot.
if [ -f /etc/default/grub ]; then
    sed -i 's/^GRUB_CMDLINE_LINUX_DEFAULT=.*/GRUB_CMDLINE_LINUX_DEFAULT="quiet loglevel=3"/' /etc/default/grub
    sed -i 's/^GRUB_CMDLINE_LINUX=.*/GRUB_CMDLINE_LINUX="console=ttyS0,115200"/' /etc/default/grub
    sed -i 's/^GRUB_TIMEOUT=.*/GRUB_TIMEOUT=0/' /etc/default/grub
    update-grub
fi

# Packer's SSH access ends with this build: no SSH server at boot (sessions have no network
# unless an egress policy gives them one, and nothing should listen then either).
rm -f /etc/ssh/sshd_config.d/packer.conf
systemctl disable ssh.service 2>/dev/null || true

apt-get clean
rm -rf "$files" /var/lib/apt/lists/*
# Fresh identity on first boot of every clone.
: >/etc/machine-id
rm -f /etc/ssh/ssh_host_*
