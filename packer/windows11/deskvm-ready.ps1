# deskvm: run at logon of `desk` (scheduled task registered by packer/windows11.pkr.hcl).
# 1. Solid desktop background #2E4A62 (deskvm's ready frame check counts that colour).
# 2. "DESKVM_READY WxH" (the primary screen's size) on COM2, the domain's second serial
#    port: the guest log deskvm reads. Windows does not follow deskvm.display=WxH (an SMBIOS
#    OEM string); set the image's resolution to what its sessions ask for.
# UNTESTED here (see packer/README.md).
$ErrorActionPreference = 'Continue'
Set-ItemProperty -Path 'HKCU:\Control Panel\Colors' -Name Background -Value '46 74 98'
Set-ItemProperty -Path 'HKCU:\Control Panel\Desktop' -Name WallPaper -Value ''
rundll32.exe user32.dll, UpdatePerUserSystemParameters

Add-Type -AssemblyName System.Windows.Forms
$screen = [System.Windows.Forms.Screen]::PrimaryScreen.Bounds
Start-Sleep -Seconds 5
$port = New-Object System.IO.Ports.SerialPort COM2, 115200, None, 8, One
$port.Open()
$port.Write("DESKVM_READY $($screen.Width)x$($screen.Height)`n")
$port.Close()
