# Windows 11 for deskvm (UNTESTED here: no Windows ISO, licence or KVM on deskvm's build
# machines; `packer validate` is all CI runs on it). Unattended install from the Windows 11
# ISO with windows11/autounattend.xml on a floppy, virtio drivers from the virtio-win ISO.
#
#   packer build -var iso_url=Win11_23H2_English_x64.iso -var iso_checksum=sha256:... \
#       -var virtio_iso=virtio-win.iso packer/windows11.pkr.hcl
#   deskvm image import packer/build/windows11-packer/windows11-packer.qcow2 --name windows11
#
# What the image gives deskvm: UEFI boot (Windows 11 needs it; the domain gets OVMF without
# secure boot, and this template disables the TPM/secure-boot checks in setup), the virtio
# disk, network, input and display drivers, automatic logon of user `desk`, and a logon task
# (windows11/deskvm-ready.ps1) that writes `DESKVM_READY WxH` to COM2, the guest log port.
# There is no guest helper (helper_port null): typing is limited to the keys of the session's
# layout, and deskvm.* options (display size, layout) reach Windows only as SMBIOS OEM
# strings, which nothing in it reads: set its resolution and layout to what sessions ask.

variable "name" {
  type    = string
  default = "windows11-packer"
}

variable "output_dir" {
  type    = string
  default = "packer/build/windows11-packer"
}

variable "iso_url" {
  type        = string
  description = "Local path of a Windows 11 x64 ISO (from Microsoft's download page)."
}

variable "iso_checksum" {
  type        = string
  description = "sha256:HEX of that ISO; required."
}

variable "virtio_iso" {
  type        = string
  default     = "virtio-win.iso"
  description = "The virtio-win driver ISO (Fedora's virtio-win project)."
}

variable "disk_size" {
  type    = string
  default = "64G"
}

variable "ovmf_firmware" {
  type        = string
  default     = "/usr/share/ovmf/OVMF.fd"
  description = "UEFI firmware (code and variables in one file; Debian's ovmf package)."
}

variable "build_password" {
  type        = string
  default     = "deskvm-build"
  sensitive   = true
  description = "Password of `desk` during the build (WinRM); set to your own."
}

source "qemu" "windows11" {
  iso_url          = var.iso_url
  iso_checksum     = var.iso_checksum
  output_directory = var.output_dir
  vm_name          = "${var.name}.qcow2"
  format           = "qcow2"
  disk_size        = var.disk_size
  disk_interface   = "virtio"
  net_device       = "virtio-net"
  machine_type     = "q35"
  accelerator      = "kvm"
  cpus             = 2
  memory           = 4096
  headless         = true
  floppy_files = [
    "${path.root}/windows11/autounattend.xml",
    "${path.root}/windows11/deskvm-ready.ps1",
  ]
  # Packer 1.6.6's QEMU builder has no UEFI options (newer QEMU plugins have efi_boot):
  # -bios with the combined OVMF image. A -drive here replaces all of Packer's default
  # drives, so the disk and both ISOs are listed (iso_url must then be a local path).
  qemuargs = [
    ["-bios", var.ovmf_firmware],
    ["-drive", "file=${var.output_dir}/${var.name}.qcow2,if=virtio,cache=writeback,discard=ignore,format=qcow2"],
    ["-drive", "file=${var.iso_url},media=cdrom,index=2"],
    ["-drive", "file=${var.virtio_iso},media=cdrom,index=3"],
  ]
  boot_wait        = "3s"
  boot_command     = ["<enter><wait><enter>"]
  communicator     = "winrm"
  winrm_username   = "desk"
  winrm_password   = var.build_password
  winrm_timeout    = "4h"
  shutdown_command = "shutdown /s /t 5 /f /d p:4:1 /c \"packer\""
}

build {
  sources = ["source.qemu.windows11"]

  provisioner "powershell" {
    inline = [
      "New-Item -ItemType Directory -Force -Path C:\\deskvm | Out-Null",
      "Copy-Item A:\\deskvm-ready.ps1 C:\\deskvm\\deskvm-ready.ps1",
      "$action = New-ScheduledTaskAction -Execute 'powershell.exe' -Argument '-NoProfile -ExecutionPolicy Bypass -File C:\\deskvm\\deskvm-ready.ps1'",
      "$trigger = New-ScheduledTaskTrigger -AtLogOn -User desk",
      "Register-ScheduledTask -TaskName deskvm-ready -Action $action -Trigger $trigger -User desk -RunLevel Highest -Force",
      "Disable-ScheduledTask -TaskName '\\Microsoft\\Windows\\WindowsUpdate\\Scheduled Start' -ErrorAction SilentlyContinue",
      "powercfg /change monitor-timeout-ac 0; powercfg /change standby-timeout-ac 0",
    ]
  }

  post-processor "shell-local" {
    inline = [
      "cp ${path.root}/windows11/windows11.deskvm.json ${var.output_dir}/${var.name}.deskvm.json"
    ]
  }
}
