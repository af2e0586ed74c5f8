# Debian 12 (bookworm) desktop for deskvm, from the netinst ISO with a preseed file.
#
#   deskvm image files debian12-desktop packer/build/guest-files --installed-system
#   packer build -var iso_checksum=sha256:<from SHA256SUMS> packer/debian12-desktop.pkr.hcl
#   deskvm image import packer/build/debian12-packer/debian12-packer.qcow2 --name debian12-packer
#
# The installer makes a minimal system (no desktop task, no display manager); the deskvm
# guest contract (the recipe's packages and guest files: autologin session user, Xorg and the
# desktop, the guest helper on virtio-serial, DESKVM_READY on ttyS1) is applied by
# scripts/deskvm-guest.sh. Output: a qcow2 and NAME.deskvm.json next to it (boot "bios").
# Packer 1.6.6 (Debian's package) has the QEMU builder built in; with Packer >= 1.7 install
# it first: packer plugins install github.com/hashicorp/qemu.

variable "name" {
  type        = string
  default     = "debian12-packer"
  description = "Output name: OUTPUT_DIR/NAME.qcow2 and OUTPUT_DIR/NAME.deskvm.json."
}

variable "guest_files_dir" {
  type        = string
  default     = "packer/build/guest-files"
  description = "Output of `deskvm image files RECIPE DIR --installed-system` (made before the build)."
}

variable "output_dir" {
  type    = string
  default = "packer/build/debian12-packer"
}

variable "iso_url" {
  type    = string
  default = "https://cdimage.debian.org/debian-cd/current/amd64/iso-cd/debian-12.8.0-amd64-netinst.iso"
}

variable "iso_checksum" {
  type        = string
  description = "sha256:HEX of the ISO (from the mirror's SHA256SUMS); required."
}

variable "disk_size" {
  type    = string
  default = "12G"
}

variable "accelerator" {
  type        = string
  default     = "kvm"
  description = "kvm, or tcg where KVM does not run (hours instead of minutes)."
}

variable "build_password" {
  type        = string
  default     = "deskvm-build"
  sensitive   = true
  description = "root password during the build only (SSH from Packer); locked at the end."
}

source "qemu" "debian12" {
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
  memory           = 2048
  headless         = true
  http_directory   = "${path.root}/http/debian12"
  boot_wait        = "5s"
  boot_command = [
    "<esc><wait>",
    "auto preseed/url=http://{{ .HTTPIP }}:{{ .HTTPPort }}/preseed.cfg ",
    "debian-installer=en_US.UTF-8 locale=en_US.UTF-8 keyboard-configuration/xkb-keymap=us ",
    "netcfg/get_hostname=deskvm netcfg/get_domain= ",
    "passwd/root-password=${var.build_password} passwd/root-password-again=${var.build_password} ",
    "console=ttyS0,115200 --- console=ttyS0,115200<enter>"
  ]
  communicator     = "ssh"
  ssh_username     = "root"
  ssh_password     = var.build_password
  ssh_timeout      = "60m"
  shutdown_command = "passwd --lock root && poweroff"
}

build {
  sources = ["source.qemu.debian12"]

  provisioner "file" {
    source      = "${var.guest_files_dir}/"
    destination = "/tmp/deskvm-files"
  }

  provisioner "shell" {
    script          = "${path.root}/scripts/deskvm-guest.sh"
    execute_command = "DESKVM_FILES=/tmp/deskvm-files sh -eu '{{ .Path }}'"
  }

  post-processor "shell-local" {
    inline = [
      "sh ${path.root}/scripts/write-metadata.sh ${var.guest_files_dir} ${var.output_dir} ${var.name} bios debian12"
    ]
  }
}
