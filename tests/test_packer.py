"""The Packer templates (packer/): `packer validate` offline, and what they hand to import.

`packer validate` (Debian's packer 1.6.6, installed by scripts/bootstrap) checks each
template fully, builders and provisioners included, without building: the ISO is a local
path that does not exist and the checksum a literal, so nothing is downloaded (a
``file:URL`` checksum would be fetched at validate time). The guest files the Linux templates
upload are the real output of ``deskvm image files`` for the default recipe.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from vm_images.guest_files import write_guest_files
from vm_images.importer import load_metadata

PACKER_DIR = Path(__file__).resolve().parent.parent / "packer"
TEMPLATES = sorted(PACKER_DIR.glob("*.pkr.hcl"))
DUMMY_CHECKSUM = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def guest_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_guest_files(
        "debian12-desktop", tmp_path_factory.mktemp("guest-files"), installed_system=True
    )


def test_the_three_templates_are_there() -> None:
    assert [t.name for t in TEMPLATES] == [
        "debian12-desktop.pkr.hcl", "ubuntu2404-desktop.pkr.hcl", "windows11.pkr.hcl",
    ]  # fmt: skip


def _validate(
    template: Path, guest_files: Path, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """``packer validate`` with the variables a build needs, offline."""
    packer = shutil.which("packer")
    assert packer is not None, "packer is not installed (scripts/bootstrap installs it)"
    args = [packer, "validate", "-var", f"iso_checksum={DUMMY_CHECKSUM}",
            "-var", f"iso_url={tmp_path / 'no.iso'}"]  # fmt: skip
    if "guest_files_dir" in template.read_text():
        args += ["-var", f"guest_files_dir={guest_files}"]
    return subprocess.run(
        [*args, str(template)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_packer_validate(template: Path, guest_files: Path, tmp_path: Path) -> None:
    done = _validate(template, guest_files, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_a_broken_template_fails_validation(
    template: Path, guest_files: Path, tmp_path: Path
) -> None:
    """The check can fail: an unknown builder option is refused."""
    broken = tmp_path / template.name
    text = template.read_text().replace('format           = "qcow2"', 'formatt = "qcow2"', 1)
    assert text != template.read_text()
    broken.write_text(text)
    done = _validate(broken, guest_files, tmp_path)
    assert done.returncode != 0 and "formatt" in done.stdout + done.stderr


def test_linux_metadata_is_what_import_accepts(guest_files: Path, tmp_path: Path) -> None:
    """write-metadata.sh turns the recipe's import metadata into NAME.deskvm.json."""
    subprocess.run(
        ["sh", str(PACKER_DIR / "scripts/write-metadata.sh"), str(guest_files), str(tmp_path),
         "debian12-packer", "bios", "debian12"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    meta = load_metadata(tmp_path / "debian12-packer.deskvm.json")
    assert meta.boot == "bios" and meta.built_by == "packer" and meta.guest_os == "debian12"
    assert meta.helper_port == "dev.deskvm.helper.0" and meta.keyboard_layout == "us"


def test_windows_metadata_is_what_import_accepts() -> None:
    meta = load_metadata(PACKER_DIR / "windows11/windows11.deskvm.json")
    assert meta.boot == "uefi" and meta.helper_port is None


def test_installer_answer_files_parse() -> None:
    user_data = (PACKER_DIR / "http/ubuntu2404/user-data").read_text()
    assert user_data.startswith("#cloud-config\n")
    autoinstall = yaml.safe_load(user_data)["autoinstall"]
    assert autoinstall["version"] == 1 and autoinstall["identity"]["username"] == "packer"
    root = ET.parse(PACKER_DIR / "windows11/autounattend.xml").getroot()
    assert root.tag.endswith("unattend")
    preseed = (PACKER_DIR / "http/debian12/preseed.cfg").read_text()
    assert "d-i grub-installer/bootdev string /dev/vda" in preseed
    assert json.loads((PACKER_DIR / "windows11/windows11.deskvm.json").read_text())
