"""The ``deskvm`` command line: host set-up, images, the bridge server, demo, recordings.

Every command reads settings once (:meth:`Settings.from_env`, then its options) and
reports deskvm errors as one red line plus a hint, with exit code 1.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.errors import ConfigError, DeskvmError
from orchestrator.interrupt import Interrupted, interruptible
from orchestrator.settings import DEFAULT_STATE_DIR, Settings

__all__ = ["app", "main"]

console = Console(stderr=True)
out = Console()
_DEFAULTS = Settings()


def _hide_flag_types() -> None:
    """Show no value type after flags in ``--help``.

    typer 0.29 prints a type column for every option, flags included
    (``--force/--no-force <bool>``, ``--help <bool>``), though a flag takes no value.
    """
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "_deskvm", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich._deskvm = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_hide_flag_types()

app = typer.Typer(
    name="deskvm",
    help=(
        "Disposable desktop VMs for computer-use agents.\n\n"
        "Boots a throwaway Debian desktop through libvirt/QEMU (no network, qcow2 overlay), "
        "carries screenshots out and mouse/keyboard actions in over a WebSocket bridge, and "
        "records every frame and input.\n\n"
        "First time on a host:  deskvm doctor --fix && deskvm image build && deskvm demo"
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
image_app = typer.Typer(
    help=(
        "Base images: build from recipes (vm_images/recipes/*.toml, offline from the host's "
        "apt sources), import, verify, list, remove. Sessions use an image only after "
        "`deskvm image verify` booted it to a ready frame (`image build` verifies by default)."
    ),
    no_args_is_help=True,
)
replay_app = typer.Typer(
    help="Inspect, verify, export, view and rerun recordings (the directory each session writes)."
)
refs_app = typer.Typer(
    help="Visual references for desktop tests (refs/<name>.png + .json; see docs/qa.md)."
)
task_app = typer.Typer(
    help="Task suites in OSWorld's format: validate them, run them with an agent (docs/tasks.md).",
    no_args_is_help=True,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            out.print(f"deskvm {version('deskvm')}", highlight=False)
        except PackageNotFoundError:
            out.print("deskvm (not installed as a package)", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True,
            help="Print deskvm's version and exit.",
        ),
    ] = False,
) -> None:  # fmt: skip
    """Disposable desktop VMs for computer-use agents."""


app.add_typer(image_app, name="image")
app.add_typer(replay_app, name="replay")
app.add_typer(refs_app, name="refs")
app.add_typer(task_app, name="task")

StateDir = Annotated[
    Path | None,
    typer.Option(
        help="State directory (images, sessions, recordings). Env: DESKVM_STATE_DIR. "
        rf"\[default: {DEFAULT_STATE_DIR}]"
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def _errors(func: F) -> F:
    """Turn deskvm errors into one clear line and exit code 1; a stop signal (Ctrl-C,
    SIGTERM, SIGHUP: see :func:`main`) into one line and exit code 128 + signal."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DeskvmError as exc:
            console.print(f"[bold red]error[/] ({exc.code}): {exc.message}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt as exc:
            name, code = "SIGINT", 130
            if isinstance(exc, Interrupted):
                name, code = exc.signal_name, exc.exit_code
            console.print(f"[yellow]interrupted ({name}); everything started was torn down[/]")
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]


def _settings(state_dir: Path | None = None, **overrides: Any) -> Settings:
    return Settings.from_env(state_dir=state_dir, **overrides)


_MARK = {
    "ok": "[green]ok[/]",
    "fixed": "[cyan]fixed[/]",
    "warn": "[yellow]warn[/]",
    "fail": "[red]FAIL[/]",
}


def setup_host(
    settings: Settings, *, fix: bool, reprobe: bool = False, report_to: Console = console
) -> str:
    """Run the doctor, printing each check to ``report_to`` (stderr unless given: the
    ``doctor`` command's report goes to stdout); return the acceleration ("kvm"/"tcg").

    Raises:
        typer.Exit: a needed check failed.
    """
    from orchestrator.host import run_doctor

    def show(check: Any) -> None:
        line = f"  {_MARK[check.status]:<18} [bold]{check.name}[/]: {check.detail}"
        if check.fix and check.status in ("fail", "warn"):
            line += f"\n  {'':<7}fix: [bold]{check.fix}[/]"
        report_to.print(line)

    report_to.print("[bold]Checking the host[/]" + (" (fixing what it can)" if fix else ""))
    report = run_doctor(
        fix=fix,
        host_file=settings.host_file,
        probe_dir=settings.state_dir / "probe",
        uri=settings.libvirt_uri,
        reprobe=reprobe,
        on_check=show,
    )
    if not report.ok or report.accel is None:
        console.print("[red]The host is not ready.[/] Fix the items above (or run with --fix).")
        raise typer.Exit(1)
    return report.accel


@app.command()
@_errors
def doctor(
    fix: Annotated[
        bool,
        typer.Option(
            "--fix/--check",
            help="Install packages, start libvirtd/virtlogd, set /dev/kvm to root:kvm 0660.",
        ),
    ] = False,
    reprobe: Annotated[
        bool, typer.Option(help="Probe KVM/TCG again even if a verdict is stored.")
    ] = False,
    state_dir: StateDir = None,
    input_check: Annotated[
        bool,
        typer.Option(
            "--input",
            help="Also boot an input-probe session and check that clicks, keys, text and"
            " scrolls arrive exactly (prints a pass/fail table; exit code 1 on a failure).",
        ),
    ] = False,
) -> None:
    """Check the host: packages, libvirt daemons, /dev/kvm permissions, acceleration.

    Acceleration is probed by booting a tiny guest: KVM only if it really runs, else TCG
    (with a warning: TCG is not a security boundary). With `--input`, a session with the
    guest's input probe is booted and a short fidelity check runs against it.
    """
    settings = _settings(state_dir)
    accel = setup_host(settings, fix=fix, reprobe=reprobe, report_to=out)  # the report: stdout
    out.print(f"[green]Host ready[/] (acceleration: {accel}).")
    if input_check and not _input_check(settings):
        raise typer.Exit(1)


def _input_check(settings: Settings) -> bool:
    """Boot a probe session, run :func:`agent_bridge.input_check.run_input_check`, print it."""
    import secrets

    from agent_bridge.client import Client
    from agent_bridge.input_check import run_input_check
    from agent_bridge.runtime import BackgroundServer, build_manager
    from agent_bridge.server import create_app

    width_px, height_px = 1280, 800
    manager = build_manager(settings)
    manager.reap()
    token = secrets.token_urlsafe(24)
    with (
        BackgroundServer(create_app(manager, token=token, settings=settings)) as server,
        Client(server.url, token) as client,
    ):
        with console.status("booting a session with the input probe..."):
            session = client.create_session(
                width=width_px, height=height_px, autostart="input-probe"
            )
        with session:
            rows = run_input_check(session, width_px, height_px)
    table = Table("case", "result", "guest received")
    for row in rows:
        table.add_row(row.case, "[green]pass[/]" if row.ok else "[red]FAIL[/]", row.detail)
    out.print(table)
    failed = sum(not r.ok for r in rows)
    out.print(
        f"[green]input fidelity: {len(rows)} of {len(rows)} cases pass[/]"
        if not failed
        else f"[red]input fidelity: {failed} of {len(rows)} cases FAIL[/]"
    )
    return not failed


def build_image_with_progress(name: str, settings: Settings, *, force: bool = False) -> Any:
    """Build (or find cached) image ``name`` with a progress bar; returns the BootImage.

    The recipe is validated first: a bad name or recipe errors before any bar is drawn.
    """
    from vm_images import build_image, load_recipe

    recipe = load_recipe(name)  # ImageNotFound / RecipeError before drawing anything
    with Progress(
        TextColumn("[bold]image[/] {task.fields[name]}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("build", total=1.0, name=recipe.name, phase="starting")

        def update(phase: str, fraction: float) -> None:
            progress.update(task, completed=fraction, phase=phase)

        image = build_image(name, settings.images_dir, progress=update, force=force)
        progress.update(task, completed=1.0, phase="built")
    return image


def verify_image_with_progress(
    name: str,
    settings: Settings,
    *,
    width_px: int | None = None,
    height_px: int | None = None,
    boot_timeout_s: float | None = None,
    content_hash: str | None = None,
) -> Any:
    """Boot image ``name`` to a ready frame (spinner + elapsed time) and mark it verified."""
    from rich.progress import SpinnerColumn

    from agent_bridge.runtime import verify_image
    from vm_images import find_image

    image = find_image(
        name, settings.images_dir, require_verified=False, content_hash=content_hash
    )  # fail early
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]verify[/] {task.fields[name]} {task.fields[hash]}"),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(
            "verify", total=None, name=name, hash=image.content_hash[:12], phase="defining"
        )
        outcome = verify_image(
            settings,
            name,
            width_px=width_px,
            height_px=height_px,
            boot_timeout_s=boot_timeout_s,
            content_hash=content_hash,
            on_started=lambda sid: progress.update(
                task, phase=f"booting session {sid} until its ready frame"
            ),
        )
        progress.update(task, phase=f"ready in {outcome.boot_to_ready_s:.1f} s", total=1,
                        completed=1)  # fmt: skip
    console.print(
        f"[green]Image {name} verified[/]: ready frame after {outcome.boot_to_ready_s:.1f} s "
        f"(frame: {outcome.verified_json.with_name('ready.png')}, recording: {outcome.recording})"
    )
    return outcome


RecipeArg = Annotated[
    str | None,
    typer.Argument(
        help="Recipe name (see `deskvm image ls`) or path of a recipe file NAME.toml. "
        "Default: the default image.",
        show_default=False,
    ),
]


@image_app.command("build")
@_errors
def image_build(
    name: RecipeArg = None,
    force: Annotated[
        bool, typer.Option(help="Rebuild even if an image of this recipe exists.")
    ] = False,
    verify: Annotated[
        bool,
        typer.Option(
            help="Boot the image to a ready frame afterwards (sessions refuse unverified "
            "images). Skipped when the image is already verified."
        ),
    ] = True,
    state_dir: StateDir = None,
) -> None:
    """Build a base image from its recipe (mmdebstrap, offline; cached by content hash).

    The recipe is validated before anything is built. With --verify (the default) the new
    image is then booted once until its ready frame, which makes it usable by sessions.

    Examples: deskvm image build; deskvm image build debian12-full;
    deskvm image build ./my-desktop.toml --no-verify
    """
    from vm_images import find_image

    settings = _settings(state_dir)
    name = name or settings.default_image
    t0 = time.monotonic()
    image = build_image_with_progress(name, settings, force=force)
    console.print(
        f"[green]Image {image.name}[/] {image.content_hash[:12]} at {image.base_path.parent} "
        f"({time.monotonic() - t0:.1f} s)"
    )
    if not verify:
        console.print(f"not verified yet: run `deskvm image verify {image.name}`")
        return
    from vm_images import ImageNotVerified

    try:
        find_image(image.name, settings.images_dir)
        console.print("already verified")
    except ImageNotVerified:
        verify_image_with_progress(image.name, settings)


@image_app.command("verify")
@_errors
def image_verify(
    name: Annotated[
        str | None, typer.Argument(help="Image name (default: the default image).")
    ] = None,
    width: Annotated[
        int | None, typer.Option(help="Display width in pixels (default: the image's).")
    ] = None,
    height: Annotated[
        int | None, typer.Option(help="Display height in pixels (default: the image's).")
    ] = None,
    timeout_s: Annotated[
        float | None,
        typer.Option("--timeout-s", help="Seconds to wait for the ready frame."),
    ] = None,
    content_hash: Annotated[
        str | None,
        typer.Option(
            "--hash", help="Verify the stored version whose hash starts with this (>= 6 hex)."
        ),
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Boot an image once until its ready frame; only then may sessions use it.

    The guest must report DESKVM_READY on its guest log and the frame must pass the image's
    check (background, windows, and bands such as a panel). Records verified.json and the
    ready frame (ready.png) next to the image. Exit code 1 if it does not get there.
    """
    settings = _settings(state_dir)
    verify_image_with_progress(
        name or settings.default_image, settings, width_px=width, height_px=height,
        boot_timeout_s=timeout_s, content_hash=content_hash,
    )  # fmt: skip


def _size(num_bytes: int) -> str:
    if num_bytes >= 1024**3:
        return f"{num_bytes / 1024**3:.2f} GiB"
    return f"{num_bytes / 1024**2:.0f} MiB"


@image_app.command("ls")
@_errors
def image_ls(
    all_versions: Annotated[
        bool, typer.Option("--all", help="Also images of older recipe versions.")
    ] = False,
    state_dir: StateDir = None,
) -> None:
    """List images: name, content hash, size, build date, verified, and recipes not built."""
    from vm_images import image_records, list_recipes

    settings = _settings(state_dir)
    records = image_records(settings.images_dir)
    # Compact enough for 80 columns: header rule only, two spaces between columns, the
    # name never truncated or wrapped, a short hash, the build date without the time.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("name", no_wrap=True)
    table.add_column("hash", no_wrap=True)
    table.add_column("size", no_wrap=True)
    table.add_column("built", no_wrap=True)
    for column in ("verified", "source", "boot"):
        table.add_column(column)
    shown = set()
    unverified = []
    for r in records:
        if not (r.current or all_versions):
            continue
        shown.add(r.name)
        if r.verified is not None:
            verified = f"[green]yes[/], {r.verified.boot_to_ready_s:.0f} s {r.verified.accel}"
        else:
            verified = "[yellow]no[/]"
            if r.current:
                unverified.append(r.name)
        name = r.name if r.current else f"[dim]{r.name} (old)[/]"
        table.add_row(
            name, r.content_hash[:8], _size(r.size_bytes), r.built_at[:10],
            verified, r.source, r.boot,
        )  # fmt: skip
    for recipe in list_recipes():
        if recipe not in shown:
            table.add_row(recipe, "-", "-", "[yellow]not built[/]", "-", "recipe", "direct")
    out.print(table)
    for name in unverified:
        out.print(f"not verified: run `deskvm image verify {name}`")
    out.print(f"images: {settings.images_dir}")


@image_app.command("list", hidden=True)
@_errors
def image_list(state_dir: StateDir = None) -> None:
    """Same as `deskvm image ls` (kept for scripts)."""
    image_ls(all_versions=False, state_dir=state_dir)


@image_app.command("rm")
@_errors
def image_rm(
    name: Annotated[str, typer.Argument(help="Image name.")],
    content_hash: Annotated[
        str | None,
        typer.Option("--hash", help="Remove only the version whose hash starts with this."),
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Remove even if a running domain uses it (breaks it).")
    ] = False,
    state_dir: StateDir = None,
) -> None:
    """Delete an image (every version, or one with --hash). Refuses while a VM uses it."""
    from agent_bridge.runtime import domains_using
    from vm_images import image_records, remove_image

    settings = _settings(state_dir)
    targets = [
        r for r in image_records(settings.images_dir)
        if r.name == name and (content_hash is None or r.content_hash.startswith(content_hash))
    ]  # fmt: skip
    if not force:
        busy = {d for r in targets for d in domains_using(settings, r.path)}
        if busy:
            console.print(
                f"[bold red]error[/] (image_in_use): running domains use {name}: "
                f"{', '.join(sorted(busy))} (end those sessions, or --force)"
            )
            raise typer.Exit(1)
    removed = remove_image(name, settings.images_dir, content_hash=content_hash)
    for path in removed:
        console.print(f"removed {path}")


@image_app.command("import")
@_errors
def image_import(
    qcow2: Annotated[Path, typer.Argument(help="The disk image (qcow2, no backing file).")],
    name: Annotated[str, typer.Option("--name", help="Image name sessions will ask for.")],
    kernel: Annotated[
        Path | None, typer.Option(help="Kernel for direct kernel boot (with --initrd).")
    ] = None,
    initrd: Annotated[
        Path | None, typer.Option(help="Initial ramdisk for direct kernel boot.")
    ] = None,
    cmdline: Annotated[
        str | None,
        typer.Option(help="Base kernel command line for direct boot (root=..., console=...)."),
    ] = None,
    boot: Annotated[
        str | None,
        typer.Option(help="bios or uefi: the image boots with its own boot loader (no --kernel)."),
    ] = None,
    metadata: Annotated[
        Path | None,
        typer.Option(
            help="Metadata JSON (boot, ready check, helper port); default FILE.deskvm.json "
            "next to the qcow2 if present (the Packer templates write it)."
        ),
    ] = None,
    verify: Annotated[
        bool, typer.Option(help="Boot it to a ready frame afterwards (makes it usable).")
    ] = True,
    state_dir: StateDir = None,
) -> None:
    """Import a qcow2 built elsewhere (e.g. by packer/) and verify it like a built image.

    Examples: deskvm image import out/debian12-packer.qcow2 --name debian12-packer --boot bios;
    deskvm image import disk.qcow2 --name mine --kernel vmlinuz --initrd initrd.img
    """
    from vm_images.importer import import_image, load_metadata, metadata_beside

    if boot not in (None, "bios", "uefi"):
        raise typer.BadParameter(f"--boot must be bios or uefi, not {boot!r}")
    settings = _settings(state_dir)
    meta_path = metadata if metadata is not None else metadata_beside(qcow2)
    meta = None
    if metadata is not None or meta_path.is_file():
        meta = load_metadata(meta_path)
        console.print(f"metadata: {meta_path}")
    with Progress(
        TextColumn("[bold]import[/] {task.fields[name]}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("import", total=1.0, name=name, phase="checking")

        def update(phase: str, fraction: float) -> None:
            progress.update(task, completed=fraction, phase=phase)

        image = import_image(
            qcow2, name, settings.images_dir, metadata=meta,
            boot=boot,  # type: ignore[arg-type]
            kernel=kernel, initrd=initrd, kernel_cmdline=cmdline, progress=update,
        )  # fmt: skip
        progress.update(task, completed=1.0, phase="imported")
    console.print(
        f"[green]Image {image.name}[/] {image.content_hash[:12]} ({image.boot} boot) at "
        f"{image.base_path.parent}"
    )
    if verify:
        verify_image_with_progress(name, settings)
    else:
        console.print(f"not verified yet: run `deskvm image verify {name}`")


@image_app.command("files")
@_errors
def image_files(
    name: Annotated[str, typer.Argument(help="Recipe name or path of a recipe file.")],
    target: Annotated[Path, typer.Argument(help="Directory to write (must be empty).")],
    installed_system: Annotated[
        bool,
        typer.Option(
            help="For a system an installer made (Packer): leave out fstab, hostname, hosts "
            "and the direct-boot initramfs configuration."
        ),
    ] = False,
) -> None:
    """Write a recipe's guest files for other image tools (the Packer templates use it).

    DIR/rootfs (file sets + generated files), DIR/packages.txt, DIR/finalize.sh and
    DIR/deskvm-image.json (import metadata without "boot").
    """
    from vm_images.guest_files import write_guest_files

    try:
        out_dir = write_guest_files(name, target, installed_system=installed_system)
    except FileExistsError as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(f"guest files of {name} in {out_dir}")


@app.command()
@_errors
def serve(
    host: Annotated[
        str | None,
        typer.Option(
            help="Address to listen on. Keep 127.0.0.1 unless behind TLS. \\[default: 127.0.0.1]"
        ),
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port. \\[default: 8765]")] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            metavar="PATH",
            help="TOML config file: a \\[serve] table (host, port and the settings by name) "
            "and \\[\\[warm_pool]] tables (image, size, width_px, height_px, memory_mib, vcpus, "
            "egress); "
            "the environment and these flags override it. \\[default: DESKVM_CONFIG, else "
            "/etc/deskvm/serve.toml if it exists]",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Admin bearer token (default: DESKVM_TOKEN, else the token file, else new).",
        ),
    ] = None,
    max_sessions: Annotated[
        int | None,
        typer.Option(help=rf"Concurrent sessions accepted. \[default: {_DEFAULTS.max_sessions}]"),
    ] = None,
    max_total_memory_mib: Annotated[
        int | None,
        typer.Option(
            help="Sum of live sessions' memory hard limits accepted, MiB. \\[default: derived "
            "from the host's RAM]"
        ),
    ] = None,
    session_ttl_s: Annotated[
        float | None,
        typer.Option(
            help="A session's lifetime when its create gives no ttl_s, seconds. "
            rf"\[default: {_DEFAULTS.session_ttl_s:g}]"
        ),
    ] = None,
    idle_timeout_s: Annotated[
        float | None,
        typer.Option(
            help="Idle timeout (no action) when a create gives none, seconds. "
            rf"\[default: {_DEFAULTS.idle_timeout_s:g}]"
        ),
    ] = None,
    allowed_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="WebSocket Origin accepted from browsers (repeatable). \\[default: none; "
            "Env: DESKVM_ALLOWED_ORIGINS]"
        ),
    ] = None,
    egress_upstream_iface: Annotated[
        str | None,
        typer.Option(
            help=(
                "Interface allowed session traffic leaves by (enables egress policies). "
                "Env: DESKVM_EGRESS_UPSTREAM_IFACE."
            ),
        ),
    ] = None,
    egress_upstream_dns: Annotated[
        str | None,
        typer.Option(
            help=(
                "IP[,IP]: resolvers the per-session DNS forwards allowlisted names to. "
                "Env: DESKVM_EGRESS_UPSTREAM_DNS."
            ),
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Serve the sessions of a Ray cluster (host:port of its GCS) instead of this"
            " host's: place each session with Ray, proxy calls to its node (docs/scale-out.md)."
            " Any number of bridges may serve one cluster.",
        ),
    ] = None,
    placement_timeout_s: Annotated[
        float,
        typer.Option(help="With --ray: seconds Ray may take to place a session, then 503."),
    ] = 2.0,
    require_accel: Annotated[
        str | None,
        typer.Option(help="With --ray: place sessions only on nodes with this accel (kvm)."),
    ] = None,
    node_ip_address: Annotated[
        str | None,
        typer.Option(help="With --ray: this host's address in the cluster (default: Ray's)."),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="This server's name in the installation (default serve-<port>). A server "
            "restarted under the same name takes back the sessions the last one left "
            "running. Env: DESKVM_SERVER_NAME.",
        ),
    ] = None,
    on_exit: Annotated[
        str | None,
        typer.Option(
            help="At a graceful shutdown (Ctrl-C, SIGTERM): 'close' every session (default), "
            "or 'keep' them running for a restart (an upgrade) to take back. Env: "
            "DESKVM_ON_EXIT.",
        ),
    ] = None,
    adopt_grace_s: Annotated[
        float | None,
        typer.Option(
            help="How long sessions of a server that went away (crash, kill -9, "
            "--on-exit keep) wait for it to restart before any server reaps them, seconds "
            "(default 300). Env: DESKVM_ADOPT_GRACE_S.",
        ),
    ] = None,
    max_ttl_s: Annotated[
        float | None,
        typer.Option(
            help="Longest lifetime a session may get, at create or by PATCH ttl_s, seconds "
            "(default 7 days). Env: DESKVM_SESSION_MAX_TTL_S.",
        ),
    ] = None,
    warm_pool: Annotated[
        str | None,
        typer.Option(
            help="IMAGE:N[,IMAGE:N]: keep N desktops of IMAGE (1280x800, 2048 MiB, 2 vCPUs, "
            "no network) restored from a saved state and ready; a matching POST "
            '/v1/sessions takes one over in about a second ("start": "warm"). Their '
            "memory counts in --max-total-memory-mib. IMAGE:egress keeps one desktop saved "
            "with a NIC for sessions with an egress policy (restored onto each one's own "
            "network at the claim, about 3 s). Env: DESKVM_WARM_POOL.",
        ),
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Run the bridge server: REST to create sessions, a WebSocket per session for actions.

    The token is printed once and kept in <state-dir>/token (mode 0600), unless given by
    --token or DESKVM_TOKEN (then it is not stored anywhere); session tokens
    are signed with <state-dir>/token-signing.key, so they outlive a restart. A restart
    loses no session: a server killed (or stopped with --on-exit keep) and started again
    under the same name takes back its running sessions (their recordings continue after
    a marked gap); sessions whose server stays gone longer than --adopt-grace-s are
    reaped and their recordings sealed as truncated. Sessions still running at a plain
    shutdown (Ctrl-C) are destroyed. Sessions past their TTL or idle timeout are ended.
    Without --egress-upstream-iface/-dns, sessions asking for an egress policy are
    refused (422 egress_not_configured); sessions without one never have a NIC.
    """
    from agent_bridge.runtime import build_authority, build_manager, ensure_token
    from agent_bridge.server import create_app, listen, run_server
    from orchestrator.settings import read_serve_config, split_csv

    file = read_serve_config(config)
    host = host or file.host or "127.0.0.1"
    port = port if port is not None else file.port if file.port is not None else 8765
    settings = Settings.from_env(
        config=file.settings,
        state_dir=state_dir,
        token=token,
        max_sessions=max_sessions,
        max_total_memory_mib=max_total_memory_mib,
        session_ttl_s=session_ttl_s,
        idle_timeout_s=idle_timeout_s,
        allowed_origins=tuple(allowed_origin) if allowed_origin else None,
        egress_upstream_iface=egress_upstream_iface,
        egress_upstream_dns=split_csv(egress_upstream_dns) if egress_upstream_dns else None,
        on_exit=on_exit,
        adopt_grace_s=adopt_grace_s,
        session_max_ttl_s=max_ttl_s,
        server_name=name,
        warm_pool=warm_pool,
    )
    if ray_address is not None:
        _serve_ray(
            settings,
            ray_address,
            host=host,
            port=port,
            placement_timeout_s=placement_timeout_s,
            require_accel=require_accel,
            node_ip=node_ip_address,
        )
        return
    # The port first: a second server on a busy port fails here, before it starts
    # anything or prints a token.
    sock = listen(host, port)
    try:
        manager = build_manager(settings, server_name=settings.server_name or f"serve-{port}")
        token_value = ensure_token(settings)
        app_ = create_app(
            manager, token=token_value, settings=settings, authority=build_authority(settings)
        )
    except BaseException:
        sock.close()
        raise
    console.print(
        f"[bold]deskvm bridge[/] on http://{host}:{port}  "
        f"(acceleration: {manager.hypervisor.accel}, server name {manager.owner!r}, "
        f"on exit: {settings.on_exit} sessions)"
    )
    if file.path is not None:
        console.print(f"config: {file.path}")
    if manager.pool is not None:
        targets = ", ".join(
            f"{t['image']}:{t['size']} ({t['display'][0]}x{t['display'][1]}, "
            f"{t['memory_mib']} MiB, {t['vcpus']} vCPUs)"
            for t in manager.pool.status()
        )
        console.print(f"warm pool: {targets} (filling in the background; GET /healthz)")
    if settings.egress_upstream_iface:
        console.print(
            f"egress: upstream {settings.egress_upstream_iface}, DNS "
            f"{','.join(settings.egress_upstream_dns)}"
        )
    else:
        console.print("egress: not configured (sessions with an egress policy are refused)")
    console.print(f"token: [bold]{token_value}[/]  ({_token_source(settings, given=token)})")
    console.print(f"docs:  http://{host}:{port}/docs   protocol: docs/protocol.md")
    # soft_wrap: a URL longer than the terminal is left whole for copying, not folded.
    base = f"http://{host}:{port}"
    console.print(f"sessions:      {base}/ui/#token={token_value}", soft_wrap=True)
    console.print(f"replay viewer: {base}/replay/#token={token_value}", soft_wrap=True)
    run_server(app_, host=host, port=port, sock=sock)


def _token_source(settings: Settings, *, given: str | None) -> str:
    """Where the admin token printed by ``serve`` lives (a given token is not stored)."""
    if given is not None:
        return f"given by --token; not stored ({settings.token_file} is not used)"
    if settings.token:
        return f"from DESKVM_TOKEN; not stored ({settings.token_file} is not used)"
    return f"also in {settings.token_file}"


def _serve_ray(
    settings: Settings,
    address: str,
    *,
    host: str,
    port: int,
    placement_timeout_s: float,
    require_accel: str | None,
    node_ip: str | None,
) -> None:
    """``deskvm serve --ray``: a bridge of the cluster at ``address`` (Ray imported here)."""
    from agent_bridge.cluster.launch import connect, serve_cluster
    from agent_bridge.server import listen, run_server

    if require_accel not in (None, "kvm", "tcg"):
        raise typer.BadParameter("--require-accel must be kvm or tcg")
    sock = listen(host, port)  # before joining anything or printing the token
    try:
        with console.status(f"joining the Ray cluster at {address} ..."):
            connect(address, node_ip=node_ip)
            app_, token_value = serve_cluster(
                settings,
                admin_token=settings.token,
                placement_timeout_s=placement_timeout_s,
                require_accel=require_accel,
            )
    except BaseException:
        sock.close()
        raise
    console.print(f"[bold]deskvm cluster bridge[/] on http://{host}:{port}  (Ray: {address})")
    console.print(f"token: [bold]{token_value}[/]  (the cluster's: every bridge takes it)")
    console.print(f"docs:  http://{host}:{port}/docs   design: docs/scale-out.md")
    run_server(app_, host=host, port=port, sock=sock)


@app.command()
@_errors
def node(
    ray_address: Annotated[
        str,
        typer.Option(
            "--ray", metavar="ADDRESS", help="The Ray cluster to join (host:port of its GCS)."
        ),
    ],
    name: Annotated[
        str | None,
        typer.Option(help="This node's name in the cluster (default: the host name)."),
    ] = None,
    slots: Annotated[
        int | None,
        typer.Option(help="Desktop slots (default: derived from host memory and CPUs)."),
    ] = None,
    backend: Annotated[
        str, typer.Option(help="libvirt (real VMs) or fake (no VMs: tests, benchmarks).")
    ] = "libvirt",
    fake_image: Annotated[
        list[str] | None,
        typer.Option(help="With --backend fake: an image name to pretend to have (repeatable)."),
    ] = None,
    recordings_url: Annotated[
        str | None,
        typer.Option(
            help="Ship recordings to s3://bucket/prefix (AWS settings from the environment) or a"
            " directory, while sessions run and at their end. Env: DESKVM_RECORDINGS_URL."
        ),
    ] = None,
    ship_interval_s: Annotated[
        float, typer.Option(help="Seconds between shipments of running recordings.")
    ] = 10.0,
    node_ip_address: Annotated[
        str | None,
        typer.Option(help="This host's address in the cluster (default: Ray's choice)."),
    ] = None,
    port: Annotated[int, typer.Option(help="Port of this node's session endpoint (0: any).")] = 0,
    egress_upstream_iface: Annotated[
        str | None, typer.Option(help="Interface egress-enabled sessions leave by.")
    ] = None,
    egress_upstream_dns: Annotated[
        str | None, typer.Option(help="IP[,IP]: resolvers for allowlisted names.")
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Join a Ray cluster as a VM host: declare desktop slots, memory, images and
    acceleration as Ray resources and labels, and run sessions the bridges place here.

    Runs `ray start --address ADDRESS --block` for this host, then this host's deskvm agent
    (its session manager and session endpoint). Ctrl-C drains: sessions are closed, their
    recordings shipped, the node leaves. See docs/scale-out.md.
    """
    import os
    import socket

    from agent_bridge.cluster.launch import host_capacity, run_node
    from orchestrator.settings import split_csv

    if backend not in ("libvirt", "fake"):
        raise typer.BadParameter("--backend must be libvirt or fake")
    settings = _settings(
        state_dir,
        egress_upstream_iface=egress_upstream_iface,
        egress_upstream_dns=split_csv(egress_upstream_dns) if egress_upstream_dns else None,
    )
    node_name = name or socket.gethostname().split(".")[0]
    capacity = host_capacity(
        settings,
        name=node_name,
        backend=backend,
        slots=slots,
        fake_images=tuple(fake_image or ()),
    )
    code = run_node(
        ray_address,
        capacity,
        settings,
        node_ip=node_ip_address,
        port=port,
        recordings_url=recordings_url or os.environ.get("DESKVM_RECORDINGS_URL") or None,
        ship_interval_s=ship_interval_s,
        fake_images=tuple(fake_image or ()),
        say=lambda text: console.print(text),
    )
    raise typer.Exit(code)


@app.command()
@_errors
def demo(
    width: Annotated[int, typer.Option(help="Display width in pixels.")] = 1280,
    height: Annotated[int, typer.Option(help="Display height in pixels.")] = 800,
    out_dir: Annotated[Path, typer.Option(help="Where to save the demo's screenshots.")] = Path(
        "deskvm-demo"
    ),
    state_dir: StateDir = None,
) -> None:
    """Everything end to end: set up the host, build the image, serve, drive one session.

    Opens the xterm, types a command, takes screenshots, prints the recording path, and
    tears everything down (also on Ctrl-C).
    """
    import secrets

    from agent_bridge.client import Client
    from agent_bridge.runtime import BackgroundServer, build_manager
    from agent_bridge.server import create_app

    settings = _settings(state_dir)
    accel = setup_host(settings, fix=True)
    if accel == "tcg":
        console.print("[yellow]Guests run under TCG here: expect ~20-40 s to boot.[/]")
    build_image_with_progress(settings.default_image, settings)
    from vm_images import ImageNotVerified, find_image

    try:
        find_image(settings.default_image, settings.images_dir)
    except ImageNotVerified:
        verify_image_with_progress(settings.default_image, settings)
    manager = build_manager(settings)
    manager.reap()
    token = secrets.token_urlsafe(24)
    out_dir.mkdir(parents=True, exist_ok=True)
    with BackgroundServer(create_app(manager, token=token, settings=settings)) as server:
        console.print(f"bridge server on {server.url}")
        with Client(server.url, token) as client:
            t0 = time.monotonic()
            with console.status("booting a disposable desktop (qcow2 overlay, no network)..."):
                session = client.create_session(width=width, height=height)
            with session:
                console.print(
                    f"session [bold]{session.id}[/] ready in {time.monotonic() - t0:.1f} s"
                )
                shot = session.screenshot()
                (out_dir / "1-desktop.png").write_bytes(shot.png)
                # The xterm sits in the top-left quarter of the screen: click into it.
                session.click(width // 6, height // 6)
                marker = secrets.token_hex(4)
                # One command line: text typed while a command still runs would show up
                # interleaved with its output in the screenshot.
                command = (
                    f"echo 'hello from deskvm {marker}'; uname -sr; ls / | head -5; "
                    f"echo demo-{marker} > /dev/ttyS1"
                )
                console.print(f"typing: [bold]{command}[/]")
                session.type(command + "\n")
                deadline = time.monotonic() + 30
                while f"demo-{marker}" not in session.guest_log() and time.monotonic() < deadline:
                    time.sleep(0.3)
                shot = session.screenshot()
                (out_dir / "2-typed.png").write_bytes(shot.png)
                info = session.info()
                seen = f"demo-{marker}" in session.guest_log()
                console.print(
                    "guest confirmed the typed command on its log port: "
                    + ("[green]yes[/]" if seen else "[red]no[/]")
                )
            console.print("session deleted; domain destroyed and overlay removed")
    console.print(f"screenshots: {out_dir.resolve()}/1-desktop.png, 2-typed.png")
    console.print(f"recording:   [bold]{info.get('recording')}[/]  (deskvm replay info <dir>)")
    if not seen:
        raise typer.Exit(1)


RecordingArg = Annotated[
    str,
    typer.Argument(
        help="A recording: its directory, or its stored copy (s3://bucket/prefix/<id>,"
        " file:///dir/<id>).",
        metavar="RECORDING",
    ),
]


def _bundle(source: str) -> Path:
    """A local bundle directory for ``source``: the path itself, or a download of a stored
    recording (``s3://``, ``file://``) into a per-user cache directory.

    Raises:
        StorageError, ConfigError: the stored recording cannot be fetched.
    """
    from orchestrator.storage import fetch_bundle, is_storage_url, split_recording_url

    if not is_storage_url(source):
        return Path(source)
    import hashlib
    import os
    import tempfile

    _, name = split_recording_url(source)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    dest = Path(tempfile.gettempdir()) / f"deskvm-replay-{os.getuid()}" / digest / name
    with console.status(f"downloading {source} ..."):
        fetch_bundle(source, dest)
    console.print(f"[dim]downloaded {source} to {dest}[/]")
    return dest


@replay_app.command("info")
@_errors
def replay_info(source: RecordingArg) -> None:
    """Summarize a recording: duration, actions by kind, frames, and chain integrity."""
    from orchestrator.replay import summarize

    path = _bundle(source)
    s = summarize(path)
    m = s.manifest
    out.print(f"[bold]recording[/] {path}")
    out.print(f"  session   {m.get('session_id')}  status {m.get('status')}")
    image = m.get("image", {})
    out.print(f"  image     {image.get('name')} {str(image.get('content_hash', ''))[:12]}")
    display = m.get("display", {})
    out.print(f"  display   {display.get('width')}x{display.get('height')}  accel {m.get('accel')}")
    out.print(f"  started   {m.get('started_at')}  ended {m.get('ended_at', '-')}")
    out.print(f"  duration  {s.duration_s:.1f} s  events {s.events}")
    out.print(f"  frames    {s.frames} ({s.frame_bytes / 1e6:.1f} MB of PNG)")
    table = Table("action", "count")
    for name, count in sorted(s.actions.items()):
        table.add_row(name, str(count))
    out.print(table)
    if s.errors:
        out.print("  errors    " + ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())))
    if m.get("status") == "truncated":
        out.print(f"  truncated {m.get('truncated_reason')}")
    for resumed in m.get("resumed") or []:
        after, why = resumed.get("after_seq"), resumed.get("reason")
        out.print(f"  gap       after event {after}: {why}")
    if s.first_bad_seq is None:
        out.print("  chain     [green]intact[/]")
    else:
        out.print(f"  chain     [red]broken at event {s.first_bad_seq}[/]")
        raise typer.Exit(1)


@replay_app.command("verify")
@_errors
def replay_verify(source: RecordingArg) -> None:
    """Recompute the hash chain and every media hash; name the first bad event.

    Exit code 0: intact and closed. 1: changed, removed, reordered or cut short (the
    first bad event is named). 2: intact as far as it goes but not closed (the writer
    crashed or is still writing; `deskvm replay seal` closes a crashed one). 3: intact up
    to event N, then sealed as truncated (the writer died; the reason is printed).
    """
    from orchestrator.replay import verify

    path = _bundle(source)
    report = verify(path)
    out.print(f"[bold]recording[/] {path}")
    out.print(f"  events    {report.events} complete, last at {report.last_t_s:.3f} s")
    out.print(f"  media     {report.media_checked} files hashed")
    if report.unfinished_video:
        out.print(f"  video     unfinished segments: {', '.join(report.unfinished_video)}")
    for video in report.truncated_video:
        playable = "playable" if video.get("playable") else "not playable"
        out.print(
            f"  video     {video.get('file')} was left open: {video.get('frames')} of "
            f"{video.get('frames_recorded')} frames decode ({playable})"
        )
    for gap in report.gaps:
        seconds = "?" if gap.get("gap_s") is None else f"{gap['gap_s']:.1f} s"
        out.print(
            f"  gap       after event {gap.get('after_seq')}: {gap.get('reason')} "
            f"({seconds}; marked at event {gap.get('seq')})"
        )
    if report.ok and report.truncated is not None:
        last = report.truncated.get("last_intact_seq")
        out.print(
            f"  verdict   [yellow]intact up to event {last}, truncated[/]: "
            f"{report.truncated.get('reason')}"
        )
        raise typer.Exit(3)
    if report.ok:
        out.print("  verdict   [green]intact and closed[/]")
        return
    if report.first_bad_seq is not None:
        out.print(f"  verdict   [red]bad at event {report.first_bad_seq}[/]: {report.problem}")
        raise typer.Exit(1)
    if report.closed:
        out.print(f"  verdict   [red]{report.problem}[/]")
        raise typer.Exit(1)
    out.print(f"  verdict   [yellow]{report.problem}[/]")
    raise typer.Exit(2)


@replay_app.command("seal")
@_errors
def replay_seal(
    path: Annotated[Path, typer.Argument(help="A recording directory left 'recording'.")],
    reason: Annotated[
        str, typer.Option(help="Why the recording stopped (written into the bundle).")
    ] = "the recorder stopped without closing the recording (sealed by `deskvm replay seal`)",
) -> None:
    """Seal a recording whose writer died (kill -9, crash) as truncated.

    Cuts an incomplete last line, closes off the video segment that was being written
    (its frames up to the last complete fragment still play; the rest is flagged), appends
    a 'truncated' event naming the last intact event and the reason, and closes the
    manifest with status 'truncated'. Refused while a live process still writes it.
    `deskvm replay verify` then says "intact up to event N, truncated" (exit code 3).
    """
    from orchestrator.clock import SystemClock
    from orchestrator.recorder import seal

    report = seal(path, SystemClock(), reason=reason)
    out.print(f"[bold]sealed[/] {path}")
    out.print(f"  intact up to event {report.last_intact_seq}")
    if report.torn_tail_bytes:
        out.print(f"  cut an incomplete last line of {report.torn_tail_bytes} bytes")
    for video in report.unfinished_video:
        out.print(
            f"  video {video['file']}: {video['frames']} of {video['frames_recorded']} "
            "frames decode" + ("" if video["playable"] else " (not playable)")
        )
    out.print(f"  reason: {report.reason}")


def _seconds(text: str) -> float:
    value = text.strip().removesuffix("s")
    try:
        return float(value)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a time like 12.5s") from None


@replay_app.command("frames")
@_errors
def replay_frames(
    source: RecordingArg,
    at: Annotated[
        list[str], typer.Option("--at", help="Time since the recording's start, e.g. 12.5s.")
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="Where to write the PNGs.")] = Path("."),
) -> None:
    """Write the frame shown at each --at time as PNG (frame-<t>s.png, full resolution)."""
    from orchestrator.replay import Recording

    recording = Recording(_bundle(source))
    out_dir.mkdir(parents=True, exist_ok=True)
    for text in at:
        t_s = _seconds(text)
        seq, image = recording.frame_at(t_s)
        target = out_dir / f"frame-{t_s:.3f}s.png"
        image.save(target)
        out.print(f"{target}  (frame event {seq}, {image.width}x{image.height})")


@replay_app.command("export")
@_errors
def replay_export(
    source: RecordingArg,
    out_path: Annotated[Path, typer.Option("--out", help="Output file (mp4) or directory.")],
    mp4: Annotated[bool, typer.Option("--mp4", help="Video, cursor and clicks drawn.")] = False,
    osworld: Annotated[
        bool, typer.Option("--osworld", help="OSWorld-style traj.jsonl + step screenshots.")
    ] = False,
    jsonl: Annotated[
        bool, typer.Option("--jsonl", help="steps.jsonl: (screenshot before, action, after).")
    ] = False,
    fps: Annotated[float, typer.Option(help="Frame rate of --mp4.")] = 5.0,
) -> None:
    """Export a recording as a video, an OSWorld trajectory or a step dataset."""
    from orchestrator.replay import export_jsonl, export_mp4, export_osworld

    if [mp4, osworld, jsonl].count(True) != 1:
        raise typer.BadParameter("choose exactly one of --mp4, --osworld, --jsonl")
    path = _bundle(source)
    if mp4:
        frames = export_mp4(path, out_path, fps=fps)
        out.print(f"{out_path}: {frames} frames at {fps:g} fps")
    elif osworld:
        steps = export_osworld(path, out_path)
        out.print(f"{out_path}/traj.jsonl: {steps} steps")
    else:
        steps = export_jsonl(path, out_path)
        out.print(f"{out_path}/steps.jsonl: {steps} steps")


@replay_app.command("view")
@_errors
def replay_view(
    source: RecordingArg,
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1 (0: any free one).")] = 8766,
) -> None:
    """Serve the browser replay viewer for one recording on 127.0.0.1 (Ctrl-C stops)."""
    import secrets

    from agent_bridge.server import run_server
    from agent_bridge.viewer import viewer_app
    from orchestrator.replay import Recording

    path = _bundle(source)
    Recording(path)  # fail early on a bad path
    token = secrets.token_urlsafe(18)
    console.print(f"open http://127.0.0.1:{port}/replay/local/#token={token}")
    run_server(viewer_app(path.resolve(), token=token), host="127.0.0.1", port=port)


@replay_app.command("rerun")
@_errors
def replay_rerun(
    source: RecordingArg,
    state_dir: StateDir = None,
) -> None:
    """Boot the recording's image afresh, replay its inputs with their timing, compare.

    Refuses if the image's content hash differs from the recorded one. Prints per step
    the SSIM of the screen at the input moment (1.0: identical) and the new recording.
    """
    from agent_bridge.runtime import build_manager
    from orchestrator.rerun import rerun

    path = _bundle(source)
    settings = _settings(state_dir)
    manager = build_manager(settings)
    table = Table("step", "action", "t (s)", "SSIM", "note")

    def show(row: Any) -> None:
        ssim = "-" if row.ssim is None else f"{row.ssim:.4f}"
        label = "final" if row.index < 0 else str(row.index)
        table.add_row(label, row.action, f"{row.t_s:.2f}", ssim, row.note)

    with console.status("rerunning (boot, then the recorded inputs in real time)..."):
        report = rerun(path, manager, boot_timeout_s=settings.boot_timeout_s, on_step=show)
    out.print(table)
    out.print(f"new recording: {report.rerun}")
    low = report.min_ssim
    out.print(f"lowest SSIM: {'-' if low is None else f'{low:.4f}'}")


@refs_app.command("import-needles")
@_errors
def refs_import_needles(
    source: Annotated[
        Path, typer.Argument(help="Directory of openQA needles (<name>.json + <name>.png).")
    ],
    out_dir: Annotated[
        Path, typer.Option("--out", help="References directory to write into.")
    ] = Path("refs"),
    recursive: Annotated[
        bool, typer.Option(help="Also convert needles in subdirectories (name: a/b).")
    ] = True,
    overwrite: Annotated[
        bool, typer.Option(help="Replace references that already exist (default: keep them).")
    ] = False,
) -> None:
    """Convert openQA needles into deskvm references.

    Each needle NAME.json + NAME.png becomes refs/NAME.png + refs/NAME.json: match areas
    (match% -> threshold 0..1), exclude areas, the largest margin as margin_px, the click
    point, tags. OCR areas are kept but not matched. Existing references are never
    replaced unless --overwrite. Exit code 1 when a needle could not be converted.

    Example: deskvm refs import-needles ~/os-autoinst-distri-opensuse/needles --out tests/refs
    """
    from agent_bridge.qa.needles import import_needles
    from agent_bridge.qa.refs import RefStore

    results = import_needles(source, RefStore(out_dir), recursive=recursive, overwrite=overwrite)
    if not results:
        console.print(f"[yellow]no needles (*.json) in {source}[/]")
        raise typer.Exit(1)
    table = Table("reference", "status", "areas", "threshold", "margin", "click", "tags")
    colour = {"written": "green", "exists": "yellow", "failed": "red"}
    for item in results:
        spec = item.spec
        areas = thresholds = margin = click = tags = ""
        if spec is not None:
            areas = f"{len(spec.match)} match"
            if spec.exclude:
                areas += f", {len(spec.exclude)} excl"
            values = sorted(
                {a.threshold if a.threshold is not None else spec.threshold for a in spec.match}
            )
            thresholds = ", ".join(f"{v:g}" for v in values)
            margin = f"{spec.margin_px} px"
            click = f"{spec.click.x},{spec.click.y}" if spec.click else "centre"
            tags = " ".join(spec.tags)
        table.add_row(
            item.name, f"[{colour[item.status]}]{item.status}[/]", areas, thresholds, margin,
            click, tags,
        )  # fmt: skip
    out.print(table)
    for item in results:
        for warning in item.warnings:
            style = "red" if item.status == "failed" else "yellow"
            out.print(f"[{style}]{item.name}[/]: {warning}", soft_wrap=True)
    counts = {s: sum(1 for r in results if r.status == s) for s in colour}
    out.print(
        f"{counts['written']} written to {out_dir}, {counts['exists']} already there"
        + (" (--overwrite replaces them)" if counts["exists"] else "")
        + f", {counts['failed']} failed"
    )
    if counts["failed"]:
        raise typer.Exit(1)


# --- task suites ----------------------------------------------------------------------------

TaskPaths = Annotated[
    list[Path],
    typer.Argument(help="Task files (OSWorld's JSON format) or directories of them (*.json).",
                   metavar="TASKS..."),
]  # fmt: skip


@task_app.command("check")
@_errors
def task_check(tasks: TaskPaths) -> None:
    """Validate task files without running them: every setup step, getter and metric must be
    one deskvm supports, with valid parameters and existing local files."""
    from agent_bridge.tasks import collect_tasks

    loaded = collect_tasks(tasks)
    table = Table("task", "setup steps", "evaluator", "file")
    for t in loaded:
        ev = t.evaluator
        funcs = f" {ev.conj} ".join(ev.funcs)
        table.add_row(t.id, ", ".join(s.type for s in t.config) or "-", funcs, t.path or "")
    out.print(table)
    out.print(f"{len(loaded)} task(s) valid")


@task_app.command("run")
@_errors
def task_run(
    tasks: TaskPaths,
    agent: Annotated[
        str | None,
        typer.Option(
            metavar="MODULE:CALLABLE",
            help="The agent: a callable (class or factory) returning an object with OSWorld's"
            " predict(instruction, obs) -> (response, actions); MODULE is dotted or a .py path."
            " Default: an agent that says DONE at once (a task it passes is broken).",
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(help="A running bridge (deskvm serve); default: start one in this process."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(help="Its admin token (default: DESKVM_TOKEN, else the token file)."),
    ] = None,
    session: Annotated[
        str | None,
        typer.Option(
            metavar="ID",
            help="Run every task in this existing session of --url (created with guest_control;"
            " kept afterwards). Default: the command creates its sessions.",
        ),
    ] = None,
    image: Annotated[str | None, typer.Option(help="Image for the sessions.")] = None,
    width: Annotated[int, typer.Option(help="Display width, pixels.")] = 1280,
    height: Annotated[int, typer.Option(help="Display height, pixels.")] = 800,
    memory_mib: Annotated[
        int | None,
        typer.Option(help="Guest memory, MiB (default: the bridge's; the full image wants 3072)."),
    ] = None,
    reuse_session: Annotated[
        bool,
        typer.Option(
            help="One session for all tasks (faster; each task's setup must reset what it"
            " checks). Default: a fresh session, and recording, per task.",
        ),
    ] = False,
    max_steps: Annotated[int, typer.Option(help="Agent predictions per task.")] = 15,
    action_space: Annotated[
        str, typer.Option(help="How the agent's plain strings are read: pyautogui | computer_13.")
    ] = "pyautogui",
    egress_allow: Annotated[
        list[str] | None,
        typer.Option(help="Egress allowlist entry for the sessions (repeatable; downloads)."),
    ] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Results directory (default: ./deskvm-tasks/<UTC time>)."),
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Run task files with an agent: results table, results.json, summary.txt, recordings.

    Every task is validated first (unsupported steps, getters or metrics are named before
    anything starts). Exit code 0 when every task passed, 1 otherwise.
    """
    from datetime import UTC, datetime

    from agent_bridge.client import Client
    from agent_bridge.tasks import DesktopEnv, DoneAgent, collect_tasks, load_agent, run_tasks

    loaded = collect_tasks(tasks)
    factory = load_agent(agent) if agent else DoneAgent
    if session is not None and url is None:
        raise ConfigError("--session names a session of a running bridge: give its --url too")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    results_dir = out_dir or Path("deskvm-tasks") / stamp
    options: dict[str, Any] = {"width": width, "height": height}
    if image is not None:
        options["image"] = image
    if memory_mib is not None:
        options["memory_mib"] = memory_mib
    if egress_allow is not None:
        options["egress_allow"] = egress_allow
    settings = _settings(state_dir)
    with contextlib.ExitStack() as stack:
        if url is None:
            import secrets

            from agent_bridge.runtime import BackgroundServer, build_manager
            from agent_bridge.server import create_app

            manager = build_manager(settings)
            manager.reap()
            token = secrets.token_urlsafe(24)
            server = stack.enter_context(
                BackgroundServer(create_app(manager, token=token, settings=settings))
            )
            url = server.url
        elif token is None:
            from agent_bridge.runtime import ensure_token

            token = ensure_token(settings)
        client = stack.enter_context(Client(url, token))
        given = client.attach(session) if session is not None else None
        env = stack.enter_context(
            DesktopEnv(
                given, client=None if given is not None else client, action_space=action_space,
                cache_dir=results_dir / "cache", reuse_session=reuse_session,
                session_options=options,
            )
        )  # fmt: skip
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
        ) as progress:  # fmt: skip
            bar = progress.add_task("tasks", total=len(loaded))
            report = run_tasks(
                loaded, factory, env=env, agent_name=agent or "DoneAgent", max_steps=max_steps,
                out_dir=results_dir,
                on_task=lambda t: progress.update(bar, description=t.id),
                on_outcome=lambda o: progress.advance(bar),
            )  # fmt: skip
    table = Table("task", "result", "score", "steps", "time", "recording / error")
    for o in report.outcomes:
        status = "[green]PASS[/]" if o.passed else ("[red]ERROR[/]" if o.error else "[red]FAIL[/]")
        detail = f"{o.error['code']}: {o.error['message']}" if o.error else (o.recording or "")
        table.add_row(o.id, status, f"{o.score:.2f}", str(o.steps), f"{o.duration_s:.1f} s", detail)
    out.print(table)
    s = report.summary
    out.print(
        f"{s['passed']}/{s['total']} passed, {s['failed']} failed, {s['errors']} errors "
        f"(mean score {s['mean_score']}); results: {report.results_path}"
    )
    if s["passed"] != s["total"]:
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point.

    SIGTERM and SIGHUP stop a command as Ctrl-C does (:mod:`orchestrator.interrupt`): what
    it started (VMs, build tools, temporary files) is torn down before it exits.
    """
    with contextlib.suppress(BrokenPipeError), interruptible():
        app()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
