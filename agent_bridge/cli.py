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
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.errors import DeskvmError
from orchestrator.settings import Settings

__all__ = ["app", "main"]

console = Console(stderr=True)
out = Console()

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
    help="Build and list VM base images (offline, from the host's apt sources)."
)
replay_app = typer.Typer(help="Inspect recordings (the directory each session writes).")
app.add_typer(image_app, name="image")
app.add_typer(replay_app, name="replay")

StateDir = Annotated[
    Path | None,
    typer.Option(help="State directory (images, sessions, recordings). Env: DESKVM_STATE_DIR."),
]

F = TypeVar("F", bound=Callable[..., Any])


def _errors(func: F) -> F:
    """Turn deskvm errors into one clear line and exit code 1 (Ctrl-C: exit 130)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DeskvmError as exc:
            console.print(f"[bold red]error[/] ({exc.code}): {exc.message}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; everything started was torn down[/]")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _settings(state_dir: Path | None = None, **overrides: Any) -> Settings:
    return Settings.from_env(state_dir=state_dir, **overrides)


_MARK = {
    "ok": "[green]ok[/]",
    "fixed": "[cyan]fixed[/]",
    "warn": "[yellow]warn[/]",
    "fail": "[red]FAIL[/]",
}


def setup_host(settings: Settings, *, fix: bool, reprobe: bool = False) -> str:
    """Run the doctor, printing each check; return the acceleration ("kvm"/"tcg").

    Raises:
        typer.Exit: a needed check failed.
    """
    from orchestrator.host import run_doctor

    def show(check: Any) -> None:
        line = f"  {_MARK[check.status]:<18} [bold]{check.name}[/]: {check.detail}"
        if check.fix and check.status in ("fail", "warn"):
            line += f"\n  {'':<7}fix: [bold]{check.fix}[/]"
        console.print(line)

    console.print("[bold]Checking the host[/]" + (" (fixing what it can)" if fix else ""))
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
) -> None:
    """Check the host: packages, libvirt daemons, /dev/kvm permissions, acceleration.

    Acceleration is probed by booting a tiny guest: KVM only if it really runs, else TCG
    (with a warning: TCG is not a security boundary).
    """
    settings = _settings(state_dir)
    accel = setup_host(settings, fix=fix, reprobe=reprobe)
    console.print(f"[green]Host ready[/] (acceleration: {accel}).")


def build_image_with_progress(name: str, settings: Settings, *, force: bool = False) -> Any:
    """Build (or find cached) image ``name`` with a progress bar; returns the BootImage."""
    from vm_images import build_image

    with Progress(
        TextColumn("[bold]image[/] {task.fields[name]}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("build", total=1.0, name=name, phase="starting")

        def update(phase: str, fraction: float) -> None:
            progress.update(task, completed=fraction, phase=phase)

        image = build_image(name, settings.images_dir, progress=update, force=force)
        progress.update(task, completed=1.0, phase="ready")
    return image


@image_app.command("build")
@_errors
def image_build(
    name: Annotated[
        str | None, typer.Argument(help="Recipe name (default: the default image).")
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Rebuild even if an image of this recipe exists.")
    ] = False,
    state_dir: StateDir = None,
) -> None:
    """Build a base image from its recipe with mmdebstrap (cached by recipe hash)."""
    settings = _settings(state_dir)
    name = name or settings.default_image
    t0 = time.monotonic()
    image = build_image_with_progress(name, settings, force=force)
    console.print(
        f"[green]Image {image.name}[/] {image.content_hash[:12]} at {image.base_path.parent} "
        f"({time.monotonic() - t0:.1f} s)"
    )


@image_app.command("list")
@_errors
def image_list(state_dir: StateDir = None) -> None:
    """List recipes and whether an image of their current content is built."""
    from orchestrator.errors import ImageNotFound
    from vm_images import find_image, list_recipes

    settings = _settings(state_dir)
    table = Table("recipe", "built", "hash", "path")
    for recipe in list_recipes():
        try:
            image = find_image(recipe, settings.images_dir)
            table.add_row(recipe, "yes", image.content_hash[:12], str(image.base_path.parent))
        except ImageNotFound:
            table.add_row(recipe, "[yellow]no[/]", "", f"deskvm image build {recipe}")
    out.print(table)


@app.command()
@_errors
def serve(
    host: Annotated[
        str, typer.Option(help="Address to listen on. Keep 127.0.0.1 unless behind TLS.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(
            help="Admin bearer token (default: DESKVM_TOKEN, else the token file, else new).",
        ),
    ] = None,
    max_sessions: Annotated[int | None, typer.Option(help="Concurrent sessions accepted.")] = None,
    state_dir: StateDir = None,
) -> None:
    """Run the bridge server: REST to create sessions, a WebSocket per session for actions.

    The token is printed once and kept in <state-dir>/token (mode 0600). Sessions still
    running at shutdown (Ctrl-C) are destroyed.
    """
    from agent_bridge.runtime import build_manager, ensure_token
    from agent_bridge.server import create_app, run_server

    settings = _settings(state_dir, token=token, max_sessions=max_sessions)
    manager = build_manager(settings)
    reaped = manager.reap()
    if reaped:
        console.print(f"reaped leftovers of dead sessions: {', '.join(reaped)}")
    token_value = ensure_token(settings)
    app_ = create_app(manager, token=token_value, settings=settings)
    console.print(
        f"[bold]deskvm bridge[/] on http://{host}:{port}  "
        f"(acceleration: {manager.hypervisor.accel})"
    )
    console.print(f"token: [bold]{token_value}[/]  (also in {settings.token_file})")
    console.print(f"docs:  http://{host}:{port}/docs   protocol: docs/protocol.md")
    run_server(app_, host=host, port=port)


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
                command = f"echo 'hello from deskvm {marker}'; uname -sr; ls / | head -5"
                console.print(f"typing: [bold]{command}[/]")
                session.type(command + "\n")
                session.type(f"echo demo-{marker} > /dev/ttyS1\n")
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


@replay_app.command("info")
@_errors
def replay_info(path: Annotated[Path, typer.Argument(help="A recording directory.")]) -> None:
    """Summarize a recording: duration, actions by kind, frames, and chain integrity."""
    from orchestrator.replay import summarize

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
    if s.first_bad_seq is None:
        out.print("  chain     [green]intact[/]")
    else:
        out.print(f"  chain     [red]broken at event {s.first_bad_seq}[/]")
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    with contextlib.suppress(BrokenPipeError):
        app()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
