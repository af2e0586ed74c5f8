"""Image recipes as data: one TOML file per image, validated before anything is built.

A recipe is ``vm_images/recipes/<name>.toml`` (or any ``<name>.toml`` given by path). Its
tables, every key checked by :class:`RecipeModel` (unknown keys are errors)::

    description = "one line"
    [base]       suite, variant, architecture, mirror_suites, components
    [packages]   install (Debian package names), recommends (bool, default false)
    [strip]      path_exclude / path_include: dpkg path filters (docs, man pages, locales,
                 kernel modules the guest never loads)
    [files]      sets: shared guest file trees (``vm_images/guest/<set>/``) copied over ``/``
                 in order; trees: directories relative to the recipe file, copied after
                 them; preseed: paths of those trees copied in *before* packages install
    [[users]]    name, uid, shell, groups, autologin (exactly one autologin user)
    [services]   enable, disable, mask (systemd units), default_target
    [desktop]    width_px, height_px (used when the host gives no size), background_rgb,
                 keyboard_layout (an XKB layout name, default "us"), autostart (commands
                 the desktop starts; ready waits for their windows)
    [boot]       kernel_cmdline, headroom_mib, helper_port, hostname, qcow2_compression
    [ready]      what a ready frame looks like: min_background_share, min_window_share,
                 [[ready.regions]] bands that must be drawn (e.g. the panel), boot_timeout_s
    [customize]  commands: shell lines run last inside the new root (keep them few)

The content hash of a recipe (:func:`recipe_hash`) covers the validated recipe (so comments
do not count), every file of its sets and trees (path, executable bit, bytes) and the
builder's format version: an image is rebuilt exactly when something that goes into it
changes.

Errors: :class:`RecipeError` (an :class:`~orchestrator.errors.ImageBuildError`, code
``invalid_recipe``) names the field, what was given and the allowed values;
:class:`~orchestrator.errors.ImageNotFound` for an unknown recipe name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from agent_bridge.protocol.keys import KEYBOARD_LAYOUTS
from orchestrator.errors import ImageBuildError, ImageNotFound
from orchestrator.spec import ReadyRegion

__all__ = [
    "BUILDER_FORMAT_VERSION",
    "GUEST_DIR",
    "RECIPES_DIR",
    "XKB_RULES",
    "ReadyModel",
    "ReadyRegionModel",
    "Recipe",
    "RecipeError",
    "RecipeModel",
    "guest_sets",
    "list_recipes",
    "load_recipe",
    "recipe_hash",
    "xkb_layouts",
]

BUILDER_FORMAT_VERSION = 4
"""Bumped whenever the builder changes what it produces; part of every content hash."""

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
"""Where the recipes shipped with deskvm live (``<name>.toml``)."""

GUEST_DIR = Path(__file__).resolve().parent / "guest"
"""Shared guest file sets (``<set>/`` mirrors the guest's ``/``), referenced by recipes."""

XKB_RULES = Path("/usr/share/X11/xkb/rules/base.lst")
"""The host's XKB layout list (Debian package ``xkb-data``) ``keyboard_layout`` is checked
against."""

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_SKIPPED_NAMES = frozenset({"__pycache__", ".DS_Store"})


class RecipeError(ImageBuildError):
    """A recipe that does not validate; the message names the field and allowed values."""

    code = "invalid_recipe"


# --- the schema ----------------------------------------------------------------------------

PackageName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9+.-]+$")]
UnitName = Annotated[
    str,
    StringConstraints(
        pattern=r"^[A-Za-z0-9@._:\\-]+\.(service|socket|timer|target|mount|automount|path|slice)$"
    ),
]
PathGlob = Annotated[str, StringConstraints(pattern=r"^/[^\s]*$")]
RelPath = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._+-][A-Za-z0-9._+/-]*$")]
Channel = Annotated[int, Field(ge=0, le=255)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BaseModelSection(_Strict):
    """``[base]``: what mmdebstrap bootstraps."""

    suite: Literal["bookworm"] = Field(
        description="Debian suite (the builder is made for bookworm's layout)"
    )
    variant: Literal["essential", "apt", "required", "minbase", "important", "standard"] = "apt"
    architecture: Literal["amd64"] = "amd64"
    mirror_suites: list[Literal["bookworm", "bookworm-updates", "bookworm-security"]] = Field(
        default_factory=lambda: ["bookworm", "bookworm-updates", "bookworm-security"],  # type: ignore[arg-type]
        min_length=1,
        description="suites of deb.debian.org taken from the host's apt sources",
    )
    components: list[Literal["main", "contrib", "non-free", "non-free-firmware"]] = Field(
        default_factory=lambda: ["main"],
        min_length=1,  # type: ignore[arg-type]
    )


class PackagesSection(_Strict):
    """``[packages]``: installed on top of the variant."""

    install: list[PackageName] = Field(min_length=1)
    recommends: bool = False

    @field_validator("install")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        dup = sorted({p for p in value if value.count(p) > 1})
        if dup:
            raise ValueError(f"packages listed twice: {', '.join(dup)}")
        return value


class StripSection(_Strict):
    """``[strip]``: dpkg path filters (kept in the guest, so later installs obey them too)."""

    path_exclude: list[PathGlob] = Field(default_factory=list)
    path_include: list[PathGlob] = Field(default_factory=list)


class FilesSection(_Strict):
    """``[files]``: guest file trees copied over ``/`` after the packages are installed."""

    sets: list[str] = Field(default_factory=list)
    trees: list[RelPath] = Field(default_factory=list)
    preseed: list[RelPath] = Field(default_factory=list)

    @field_validator("sets")
    @classmethod
    def _known_sets(cls, value: list[str]) -> list[str]:
        known = guest_sets()
        for name in value:
            if name not in known:
                raise ValueError(
                    f"unknown file set {name!r} (allowed: {', '.join(known) or 'none'})"
                )
        if len(set(value)) != len(value):
            raise ValueError("a file set is listed twice")
        return value

    @field_validator("trees", "preseed")
    @classmethod
    def _no_parent(cls, value: list[str]) -> list[str]:
        for rel in value:
            if ".." in Path(rel).parts:
                raise ValueError(f"{rel!r} must not contain '..'")
        return value


class UserModel(_Strict):
    """``[[users]]``: an account with a locked password (no sudo, no password login)."""

    name: Annotated[str, StringConstraints(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")]
    uid: int = Field(ge=1000, le=59999)
    shell: Literal["/bin/bash", "/bin/sh", "/usr/sbin/nologin"] = "/bin/bash"
    groups: list[Annotated[str, StringConstraints(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")]] = Field(
        default_factory=list
    )
    autologin: bool = False
    comment: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9 ._-]{0,64}$")] = ""


class ServicesSection(_Strict):
    """``[services]``: systemd units enabled, disabled and masked in the image."""

    enable: list[UnitName] = Field(default_factory=list)
    disable: list[UnitName] = Field(default_factory=list)
    mask: list[UnitName] = Field(default_factory=list)
    default_target: Literal["multi-user.target", "graphical.target", "deskvm-boot.target"] = (
        "multi-user.target"
    )


class DesktopSection(_Strict):
    """``[desktop]``: the session's defaults inside the guest."""

    width_px: int = Field(1280, ge=320, le=8192, multiple_of=8)
    height_px: int = Field(800, ge=200, le=8192)
    background_rgb: list[Channel] = Field(
        default_factory=lambda: [0x2E, 0x4A, 0x62], min_length=3, max_length=3
    )
    keyboard_layout: str = "us"
    autostart: list[Annotated[str, StringConstraints(pattern=r"^[^\n\r\x00]{1,400}$")]] = Field(
        default_factory=list,
        description="commands the desktop starts once it runs; ready waits for their windows",
    )

    @field_validator("keyboard_layout")
    @classmethod
    def _xkb_layout(cls, value: str) -> str:
        layouts = xkb_layouts()
        if layouts:
            if value not in layouts:
                sample = ", ".join(sorted(layouts)[:40])
                raise ValueError(
                    f"{value!r} is not an XKB layout of {XKB_RULES} (allowed: {sample}, ... "
                    f"{len(layouts)} in all)"
                )
        elif not re.fullmatch(r"[a-z]{2,8}", value):
            raise ValueError(f"{value!r} is not an XKB layout name (2-8 lowercase letters)")
        if value not in KEYBOARD_LAYOUTS:
            raise ValueError(
                f"deskvm has no key table for layout {value!r} (allowed: "
                f"{', '.join(KEYBOARD_LAYOUTS)}; tables: python -m vm_images.keyboard_tables)"
            )
        return value


class BootSection(_Strict):
    """``[boot]``: direct kernel boot and the root filesystem."""

    kernel_cmdline: Annotated[str, StringConstraints(pattern=r"^[ -~]{1,1024}$")]
    headroom_mib: int = Field(1024, ge=0, le=65536)
    helper_port: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9.]{0,62}$")] | None = None
    hostname: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")] = "deskvm"
    qcow2_compression: Literal["none", "zlib", "zstd"] = "none"

    @field_validator("kernel_cmdline")
    @classmethod
    def _no_host_options(cls, value: str) -> str:
        words = value.split()
        if not words or words[0] != "root=/dev/vda":
            raise ValueError("must start with root=/dev/vda (whole-disk ext4 on virtio-blk)")
        if any(w.startswith("deskvm.") for w in words):
            raise ValueError("deskvm.* options are appended by the host, not preset")
        return " ".join(words)


class ReadyRegionModel(_Strict):
    """``[[ready.regions]]``: a full-width band that must be drawn (e.g. a panel)."""

    name: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    top_px: int = Field(ge=-4096, le=4096, description="negative: from the bottom edge")
    height_px: int = Field(ge=1, le=512)
    min_foreground_share: float = Field(0.9, ge=0.0, le=1.0)
    min_colours: int = Field(3, ge=1, le=4096)

    def to_spec(self) -> ReadyRegion:
        return ReadyRegion(
            name=self.name,
            top_px=self.top_px,
            height_px=self.height_px,
            min_foreground_share=self.min_foreground_share,
            min_colours=self.min_colours,
        )


class ReadyModel(_Strict):
    """``[ready]``: the host's frame check, after the guest wrote ``DESKVM_READY``."""

    min_background_share: float = Field(0.10, ge=0.0, le=1.0)
    min_window_share: float = Field(0.01, ge=0.0, le=1.0)
    regions: list[ReadyRegionModel] = Field(default_factory=list)
    boot_timeout_s: float = Field(180.0, gt=0, le=3600)


class CustomizeSection(_Strict):
    """``[customize]``: shell lines run last in the new root (``/bin/sh -eu -c``)."""

    commands: list[Annotated[str, StringConstraints(min_length=1, max_length=2000)]] = Field(
        default_factory=list
    )


class RecipeModel(_Strict):
    """The whole recipe file (see the module docstring)."""

    description: Annotated[str, StringConstraints(max_length=200)] = ""
    base: BaseModelSection
    packages: PackagesSection
    strip: StripSection = Field(default_factory=StripSection)
    files: FilesSection = Field(default_factory=FilesSection)
    users: list[UserModel] = Field(min_length=1)
    services: ServicesSection = Field(default_factory=ServicesSection)
    desktop: DesktopSection = Field(default_factory=lambda: DesktopSection.model_validate({}))
    boot: BootSection
    ready: ReadyModel = Field(default_factory=lambda: ReadyModel.model_validate({}))
    customize: CustomizeSection = Field(default_factory=CustomizeSection)

    @model_validator(mode="after")
    def _one_autologin(self) -> RecipeModel:
        names = [u.name for u in self.users]
        if len(set(names)) != len(names):
            raise ValueError("users: a user name is listed twice")
        uids = [u.uid for u in self.users]
        if len(set(uids)) != len(uids):
            raise ValueError("users: a uid is listed twice")
        auto = [u.name for u in self.users if u.autologin]
        if len(auto) != 1:
            raise ValueError("users: exactly one user must have autologin = true")
        if auto[0] != "desk":
            raise ValueError(
                f"users: the autologin user is {auto[0]!r}; it must be 'desk' (the guest "
                "contract in vm_images/guest/base gives desk the guest log and helper ports)"
            )
        return self


# --- the loaded recipe -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Recipe:
    """A validated recipe and where it came from.

    Attributes:
        name: image name (the file's stem).
        path: the recipe file.
        model: the validated content.
    """

    name: str
    path: Path
    model: RecipeModel

    @property
    def description(self) -> str:
        return self.model.description

    @property
    def suite(self) -> str:
        return self.model.base.suite

    @property
    def variant(self) -> str:
        return self.model.base.variant

    @property
    def mirror_suites(self) -> tuple[str, ...]:
        return tuple(self.model.base.mirror_suites)

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self.model.base.components)

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(self.model.packages.install)

    @property
    def kernel_cmdline(self) -> str:
        return self.model.boot.kernel_cmdline

    @property
    def headroom_mib(self) -> int:
        return self.model.boot.headroom_mib

    @property
    def background_rgb(self) -> tuple[int, int, int]:
        r, g, b = self.model.desktop.background_rgb
        return (r, g, b)

    @property
    def helper_port(self) -> str | None:
        return self.model.boot.helper_port

    @property
    def keyboard_layout(self) -> str:
        return self.model.desktop.keyboard_layout

    @property
    def ready_regions(self) -> tuple[ReadyRegion, ...]:
        return tuple(r.to_spec() for r in self.model.ready.regions)

    @property
    def autologin_user(self) -> str:
        return next(u.name for u in self.model.users if u.autologin)

    def trees(self) -> list[tuple[str, Path]]:
        """``(label, directory)`` of every file tree, in copy order (sets, then trees)."""
        out = [(f"set {s}", GUEST_DIR / s) for s in self.model.files.sets]
        out += [(f"tree {t}", self.path.parent / t) for t in self.model.files.trees]
        return out


def guest_sets() -> list[str]:
    """Names of the shared guest file sets under :data:`GUEST_DIR`, sorted."""
    if not GUEST_DIR.is_dir():
        return []
    return sorted(p.name for p in GUEST_DIR.iterdir() if p.is_dir() and NAME_RE.match(p.name))


@cache
def _xkb_layouts(path: Path) -> frozenset[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return frozenset()
    layouts: set[str] = set()
    section = ""
    for line in text.splitlines():
        if line.startswith("!"):
            section = line[1:].strip()
            continue
        if section == "layout" and line.strip():
            layouts.add(line.split()[0])
    return frozenset(layouts)


def xkb_layouts() -> frozenset[str]:
    """XKB layout names of the host's :data:`XKB_RULES` (empty if xkb-data is missing)."""
    return _xkb_layouts(XKB_RULES)


def list_recipes(*, recipes_dir: Path | None = None) -> list[str]:
    """Names of the recipes that can be built, sorted.

    Args:
        recipes_dir: directory holding ``<name>.toml`` files (default :data:`RECIPES_DIR`).
    """
    root = recipes_dir if recipes_dir is not None else RECIPES_DIR
    if not root.is_dir():
        return []
    return sorted(p.stem for p in root.glob("*.toml") if p.is_file() and NAME_RE.match(p.stem))


def recipe_path(name: str, *, recipes_dir: Path | None = None) -> Path:
    """The file of a recipe given by name (shipped) or by path (``*.toml``).

    Raises:
        ImageNotFound: no such recipe.
    """
    if name.endswith(".toml") or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ImageNotFound(f"no recipe file {path}")
        if not NAME_RE.match(path.stem):
            raise ImageNotFound(
                f"recipe file name {path.name!r}: the stem is the image name and must match "
                f"{NAME_RE.pattern}"
            )
        return path.resolve()
    root = recipes_dir if recipes_dir is not None else RECIPES_DIR
    path = root / f"{name}.toml"
    if not NAME_RE.match(name) or not path.is_file():
        available = ", ".join(list_recipes(recipes_dir=root)) or "none"
        raise ImageNotFound(f"no image recipe named {name!r} (available: {available})")
    return path


def load_recipe(name: str, *, recipes_dir: Path | None = None) -> Recipe:
    """Read and validate one recipe (by name, or by the path of a ``.toml`` file).

    Checks the schema (:class:`RecipeModel`), then that every file set, tree and preseed path
    exists and that no two trees provide the same guest path.

    Raises:
        ImageNotFound: no recipe of that name.
        RecipeError: the recipe is malformed; the message names the field, the value and
            the allowed values.
    """
    path = recipe_path(name, recipes_dir=recipes_dir)
    where = f"recipe {path.stem!r} ({path})"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{where} is not valid TOML: {exc}") from exc
    try:
        model = RecipeModel.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{where} is invalid:\n{_explain(exc, RecipeModel)}") from exc
    recipe = Recipe(name=path.stem, path=path, model=model)
    _check_trees(recipe, where)
    return recipe


def _explain(exc: ValidationError, root: type[BaseModel] | None = None) -> str:
    """One line per error: dotted field path, what is wrong, what was given / allowed."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = _field_name(error["loc"])
        kind = error["type"]
        msg = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        if kind == "extra_forbidden":
            allowed = _allowed_keys(error["loc"][:-1], root or RecipeModel)
            lines.append(f"  {loc}: unknown field (allowed here: {', '.join(allowed)})")
        elif kind == "missing":
            lines.append(f"  {loc}: required field missing")
        else:
            shown = given if not isinstance(given, dict) else "{...}"
            lines.append(f"  {loc}: {msg} (given: {shown!r})")
    return "\n".join(lines)


def _field_name(loc: Sequence[int | str]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1] = f"{parts[-1]}[{item}]" if parts else f"[{item}]"
        else:
            parts.append(str(item))
    return ".".join(parts) or "(top level)"


def _allowed_keys(loc: Sequence[int | str], root: type[BaseModel]) -> list[str]:
    model = root
    for item in loc:
        if isinstance(item, int):
            continue
        field = model.model_fields.get(str(item))
        if field is None:
            break
        annotation: Any = field.annotation
        inner = getattr(annotation, "__args__", (annotation,))
        nested = next(
            (a for a in (annotation, *inner) if isinstance(a, type) and issubclass(a, BaseModel)),
            None,
        )
        if nested is None:
            break
        model = nested
    return sorted(model.model_fields)


def _check_trees(recipe: Recipe, where: str) -> None:
    owner: dict[str, str] = {}
    for label, root in recipe.trees():
        if not root.is_dir():
            raise RecipeError(f"{where}: files: {label} is not a directory ({root})")
        for file in _tree_files(root):
            rel = file.relative_to(root).as_posix()
            if rel in owner:
                raise RecipeError(
                    f"{where}: files: /{rel} is provided by both {owner[rel]} and {label}"
                )
            owner[rel] = label
    for preseed in recipe.model.files.preseed:
        if not any((root / preseed).exists() for _label, root in recipe.trees()):
            raise RecipeError(
                f"{where}: files.preseed: {preseed!r} is in none of the file sets/trees"
            )


def _tree_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_NAMES)
        for filename in sorted(filenames):
            if filename not in _SKIPPED_NAMES:
                yield Path(dirpath) / filename


def recipe_hash(name: str | Recipe, *, recipes_dir: Path | None = None) -> str:
    """The content hash an image built from this recipe now would carry.

    sha256 over ``deskvm-image-format <BUILDER_FORMAT_VERSION>``, the validated recipe as
    canonical JSON (comments and key order do not count), and for every file of its sets
    and trees, in copy order: the tree label, the relative POSIX path, whether it is
    executable, its length and its bytes. ``__pycache__`` directories are ignored.

    Args:
        name: recipe name or path, or an already loaded :class:`Recipe`.
        recipes_dir: directory holding recipes (default :data:`RECIPES_DIR`).

    Returns:
        64 lowercase hex digits.

    Raises:
        ImageNotFound: no recipe of that name.
        RecipeError: the recipe is invalid.
    """
    recipe = name if isinstance(name, Recipe) else load_recipe(name, recipes_dir=recipes_dir)
    digest = hashlib.sha256(f"deskvm-image-format {BUILDER_FORMAT_VERSION}\n".encode())
    canonical = json.dumps(recipe.model.model_dump(mode="json"), sort_keys=True)
    digest.update(f"recipe {recipe.name}\0{len(canonical)}\0{canonical}\0".encode())
    for label, root in recipe.trees():
        for path in _tree_files(root):
            rel = path.relative_to(root).as_posix()
            data = path.read_bytes()
            executable = "x" if os.stat(path).st_mode & 0o111 else "-"
            digest.update(f"{label}\0{rel}\0{executable}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()
