"""Image recipes (TOML data), the offline image builder and the image store.

Layer: below the session, above spec. Public API::

    load_recipe(name_or_path) -> Recipe          # validated; RecipeError names the field
    list_recipes() -> list[str]
    recipe_hash(name_or_recipe) -> str
    build_image(name, images_dir, *, progress=None, force=False) -> BootImage
    find_image(name, images_dir, *, require_verified=True) -> BootImage
    image_records(images_dir) -> list[ImageRecord]   # what `deskvm image ls` shows
    mark_verified(image, record, ready_png)          # after a verify boot reached ready
    remove_image(name, images_dir, *, content_hash=None)
    import_image(qcow2, name, images_dir, ...) -> BootImage
    DEFAULT_IMAGE = "debian12-desktop"

See :mod:`vm_images.recipe` for the recipe format, :mod:`vm_images.builder` for the build,
:mod:`vm_images.store` for the on-disk layout, and ``vm_images/guest/base/`` for the guest
contract (``DESKVM_READY WxH`` on ``/dev/ttyS1``, ``deskvm.display=WxH``,
``deskvm.autostart=input-probe``).
"""

from vm_images.builder import DEFAULT_IMAGE, ProgressCallback, build_image
from vm_images.importer import ImportMetadata, import_image
from vm_images.recipe import (
    BUILDER_FORMAT_VERSION,
    RECIPES_DIR,
    Recipe,
    RecipeError,
    list_recipes,
    load_recipe,
    recipe_hash,
)
from vm_images.store import (
    ImageNotVerified,
    ImageRecord,
    VerifyRecord,
    find_image,
    image_records,
    mark_verified,
    remove_image,
)

__all__ = [
    "BUILDER_FORMAT_VERSION",
    "DEFAULT_IMAGE",
    "RECIPES_DIR",
    "ImageNotVerified",
    "ImageRecord",
    "ImportMetadata",
    "ProgressCallback",
    "Recipe",
    "RecipeError",
    "VerifyRecord",
    "build_image",
    "find_image",
    "image_records",
    "import_image",
    "list_recipes",
    "load_recipe",
    "mark_verified",
    "recipe_hash",
    "remove_image",
]
