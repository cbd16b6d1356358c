"""``toolkit webui``: serve the page on localhost; another address only with --allow-remote, and a warning."""

from __future__ import annotations

import inspect
import ipaddress
import os
import signal
import urllib.parse
from pathlib import Path

import click


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Gradio's plot block clips the bottom of its vega drawing, where the legend (which line is which
# reward) goes: leave it room.
PLOT_CSS = ".toolkit-plot { overflow: visible !important; padding-bottom: 24px !important; }"


class LoopbackHostOnly:
    """ASGI middleware for a page on localhost: answer only requests addressed to a loopback name (their
    Host header). A web page whose domain an attacker re-points at 127.0.0.1 (DNS rebinding) would
    otherwise drive this page from the user's own browser, same-origin, and launch runs."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if not is_loopback(urllib.parse.urlsplit(f"//{host}").hostname or ""):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = (f"toolkit webui listens on localhost and answers only requests to localhost, not to {host!r}; "
                        "open http://127.0.0.1:PORT/ (or start it with --host ADDR --allow-remote)\n").encode()
                await send({"type": "http.response.start", "status": 421,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def serve(runs_dir: Path, data_dirs: list[Path], host: str, port: int, block: bool = True):
    """Build the page and start Gradio's server; returns the running ``gr.Blocks`` when ``block`` is False."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home (and none possible offline)
    from toolkit_webui.app import App, build
    from toolkit_webui.paths import Roots

    roots = Roots(runs_dir, data_dirs)
    roots.runs.mkdir(parents=True, exist_ok=True)
    app = App(roots)
    page = build(app)
    page.toolkit_app = app
    # Gradio serves files only from allowed_paths and its own upload/cache folders; nothing is
    # allowed here: the page shows file contents itself, after Roots has checked each path.
    page.queue(default_concurrency_limit=4)
    # Gradio's queue looks for new events every millisecond while it has none: 7% of a core for an idle page.
    # Every 20 ms is as prompt for a person and costs a twentieth of that.
    page._queue.sleep_when_free = max(page._queue.sleep_when_free, 0.02)
    from starlette.middleware import Middleware

    middleware = [Middleware(LoopbackHostOnly)] if is_loopback(host) else []
    # Gradio then asks its own server once, with a 3 s timeout, whether localhost answers, and refuses to go on
    # without a share link when it does not: a loaded machine (load 14, 2026-12-07) failed that check with the server
    # up. The page is served here and never shared, so the check is skipped where this Gradio lets it be.
    unchecked = {"_frontend": False} if "_frontend" in inspect.signature(page.launch).parameters else {}
    page.launch(server_name=host, server_port=port, share=False, ssr_mode=False, allowed_paths=[], show_error=False,
                inbrowser=False, prevent_thread_lock=True, quiet=not block, css=PLOT_CSS,
                app_kwargs={"middleware": middleware}, **unchecked)
    if not block:
        return page
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM too ends Gradio's loop, so runs below are stopped
    try:
        page.block_thread()
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.runs.close()
    return page


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@click.command("webui")
@click.option("--runs-dir", default="runs", show_default=True, type=click.Path(file_okay=False),
              help="Directory of runs: launched here, listed, exported; the page may write only inside it.")
@click.option("--data-dir", "data_dirs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="A directory the page may read datasets, models and recipes from (repeatable).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=7860, show_default=True, type=int)
@click.option("--allow-remote", is_flag=True, help="Allow --host other than localhost (anyone who reaches it can train and read runs).")
def webui_command(runs_dir: str, data_dirs: tuple[str, ...], host: str, port: int, allow_remote: bool) -> None:
    """Compose, launch and watch runs in a browser; forms come from the installed plugins.

    Listens on 127.0.0.1 only unless --allow-remote; reads files only inside --runs-dir and --data-dir.
    Closing it (Ctrl-C) stops its runs, each with a checkpoint; resume them from the page later.
    """
    if not is_loopback(host):
        if not allow_remote:
            raise click.UsageError(f"--host {host} would let other machines use this page (launch runs, read the runs "
                                   "directory); add --allow-remote if that is what you want")
        click.echo(f"toolkit webui: WARNING: listening on {host}:{port}: anyone who can reach it can start training (which "
                   "runs any installed Python function a plugin option names, such as a reward's module:function) and "
                   f"read {Path(runs_dir).resolve()} and the data directories. There is no login.", err=True)
    serve(Path(runs_dir), [Path(d) for d in data_dirs], host, port)
