"""Image recipes and the offline image builder (layer: below the session, above spec).

Public API::

    build_image(name, images_dir, *, progress=None, force=False) -> BootImage
    find_image(name, images_dir) -> BootImage        # raises ImageNotFound if not built
    list_recipes() -> list[str]
    DEFAULT_IMAGE = "debian12-desktop"

See :mod:`vm_images.builder` for the image layout and the content hash, and
``vm_images/recipes/debian12-desktop/`` for the guest contract (``DESKVM_READY WxH`` on
``/dev/ttyS1``, ``deskvm.display=WxH``, ``deskvm.autostart=input-probe``).
"""

from vm_images.builder import (
    BUILDER_FORMAT_VERSION,
    DEFAULT_IMAGE,
    RECIPES_DIR,
    ProgressCallback,
    Recipe,
    build_image,
    find_image,
    list_recipes,
    load_recipe,
    recipe_hash,
)

__all__ = [
    "BUILDER_FORMAT_VERSION",
    "DEFAULT_IMAGE",
    "RECIPES_DIR",
    "ProgressCallback",
    "Recipe",
    "build_image",
    "find_image",
    "list_recipes",
    "load_recipe",
    "recipe_hash",
]
