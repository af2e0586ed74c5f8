# Ubuntu 24.04 LTS desktop for deskvm, from the live-server ISO with autoinstall (cloud-init
# NoCloud user-data served by Packer's HTTP server).
#
#   deskvm image files debian12-desktop packer/build/guest-files --installed-system
#   packer build -var iso_checksum=sha256:<from SHA256SUMS> packer/ubuntu2404-desktop.pkr.hcl
#   deskvm image import packer/build/ubuntu2404-packer/ubuntu2404-packer.qcow2 --name ubuntu2404-packer
#
# Autoinstall makes a minimal server system; scripts/deskvm-guest.sh then applies the deskvm
# guest contract (the recipe's packages that Ubuntu has, Xorg and the desktop, session user
# `desk` with autologin, guest helper, DESKVM_READY on ttyS1). Set extra_packages (e.g.
# "ubuntu-desktop-minimal firefox") for Ubuntu's own desktop applications. Output: a qcow2 and
# NAME.deskvm.json next to it (boot "bios"). Packer >= 1.7: packer plugins install
# github.com/hashicorp/qemu first.

variable "name" {
  type    = string
  default = "ubuntu2404-packer"
}

variable "guest_files_dir" {
  type    = string
  default = "packer/build/guest-files"
}

variable "output_dir" {
  type    = string
  default = "packer/build/ubuntu2404-packer"
}

variable "iso_url" {
  type    = string
  default = "https://releases.ubuntu.com/24.04/ubuntu-24.04.1-live-server-amd64.iso"
}

variable "iso_checksum" {
  type        = string
  description = "sha256:HEX of the ISO (from SHA256SUMS next to it); required."
}

variable "extra_packages" {
  type        = string
  default     = ""
  description = "Space-separated Ubuntu packages installed after the guest contract."
}

variable "disk_size" {
  type    = string
  default = "16G"
}

variable "accelerator" {
  type    = string
  default = "kvm"
}

variable "build_password" {
  type        = string
  default     = "deskvm-build"
  sensitive   = true
  description = "The build user's SSH password (user 'packer', removed at the end)."
}

source "qemu" "ubuntu2404" {
  iso_url          = var.iso_url
  iso_checksum     = var.iso_checksum
  output_directory = var.output_dir
  vm_name          = "${var.name}.qcow2"
  format           = "qcow2"
  disk_size        = var.disk_size
  disk_interface   = "virtio"
  net_device       = "virtio-net"
  machine_type     = "q35"
  accelerator      = var.accelerator
  cpus             = 2
  memory           = 4096
  headless         = true
  http_directory   = "${path.root}/http/ubuntu2404"
  boot_wait        = "5s"
  # GRUB of the live ISO: load the installer kernel with autoinstall from our NoCloud seed.
  boot_command = [
    "c<wait>",
    "linux /casper/vmlinuz --- autoinstall ds='nocloud-net;s=http://{{ .HTTPIP }}:{{ .HTTPPort }}/' console=ttyS0,115200<enter><wait>",
    "initrd /casper/initrd<enter><wait>",
    "boot<enter>"
  ]
  communicator           = "ssh"
  ssh_username           = "packer"
  ssh_password           = var.build_password
  ssh_timeout            = "90m"
  ssh_handshake_attempts = 200
  shutdown_command       = "echo '${var.build_password}' | sudo -S sh -c 'userdel -r packer; poweroff'"
}

build {
  sources = ["source.qemu.ubuntu2404"]

  provisioner "file" {
    source      = "${var.guest_files_dir}/"
    destination = "/tmp/deskvm-files"
  }

  provisioner "shell" {
    script          = "${path.root}/scripts/deskvm-guest.sh"
    execute_command = "echo '${var.build_password}' | sudo -S env DESKVM_FILES=/tmp/deskvm-files sh -eu '{{ .Path }}'"
  }

  provisioner "shell" {
    inline = [
      "if [ -n '${var.extra_packages}' ]; then echo '${var.build_password}' | sudo -S sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q ${var.extra_packages} && systemctl disable gdm3.service 2>/dev/null; systemctl set-default multi-user.target; apt-get clean'; fi"
    ]
  }

  post-processor "shell-local" {
    inline = [
      "sh ${path.root}/scripts/write-metadata.sh ${var.guest_files_dir} ${var.output_dir} ${var.name} bios ubuntu24.04"
    ]
  }
}
