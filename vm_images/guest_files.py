"""Write a recipe's guest files to a directory, for images built by other tools (Packer).

``deskvm image files RECIPE DIR`` lays out what the offline builder would put into the root
filesystem, so that a Packer template can upload and apply it on a system an installer made::

    DIR/rootfs/          the recipe's file sets and trees merged, plus the generated files
                         (image.conf, keyboard, autostart...), modes normalized
    DIR/packages.txt     the recipe's packages, one per line
    DIR/finalize.sh      the generated script (users, services, caches, customize.commands)
    DIR/deskvm-image.json  the recipe's ready check, helper port, background (import metadata
                         fields; the template adds ``boot``)

With ``installed_system=True`` (the Packer case) the files an installer owns are left out:
``/etc/fstab``, ``/etc/hostname``, ``/etc/hosts`` and the preseed paths (the small
direct-boot initramfs configuration), and finalize.sh skips the initrd check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vm_images.builder import _stage_files, finalize_script, generated_files
from vm_images.recipe import load_recipe

__all__ = ["INSTALLER_OWNED", "write_guest_files"]

INSTALLER_OWNED = ("etc/fstab", "etc/hostname", "etc/hosts")
"""Generated files an installed system keeps its own version of."""


def write_guest_files(name: str, target: Path, *, installed_system: bool = False) -> Path:
    """Materialize recipe ``name`` (name or ``.toml`` path) into ``target`` (created).

    Returns:
        ``target``.

    Raises:
        ImageNotFound, RecipeError: as :func:`vm_images.recipe.load_recipe`.
        FileExistsError: ``target`` exists and is not empty.
    """
    recipe = load_recipe(name)
    generated = generated_files(recipe)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty")
    target.mkdir(parents=True, exist_ok=True)
    rootfs = target / "rootfs"
    if installed_system:
        generated = {k: v for k, v in generated.items() if k not in INSTALLER_OWNED}
    _stage_files(recipe, generated, rootfs)
    script = finalize_script(recipe)
    if installed_system:
        for preseed in recipe.model.files.preseed:
            shutil.rmtree(rootfs / preseed, ignore_errors=True)
        # The distribution initrd's module check (recipes whose file sets bring no initrd of
        # their own have it): an installed system boots its own initrd.
        start = script.find("kver=$(ls /lib/modules")
        if start != -1:
            end = script.index("done\n", start) + len("done\n")
            script = script[:start] + script[end:]
    (target / "finalize.sh").write_text(script, encoding="utf-8")
    (target / "packages.txt").write_text("\n".join(recipe.packages) + "\n", encoding="utf-8")
    m = recipe.model
    meta = {
        "format": "deskvm-image/1",
        "description": recipe.description,
        "helper_port": m.boot.helper_port,
        "background_rgb": list(m.desktop.background_rgb),
        "keyboard_layout": m.desktop.keyboard_layout,
        "ready": m.ready.model_dump(mode="json"),
    }
    (target / "deskvm-image.json").write_text(json.dumps(meta, indent=2) + "\n", "utf-8")
    return target
