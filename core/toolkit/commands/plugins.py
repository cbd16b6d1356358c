"""``toolkit plugins``: what is installed, from which distribution, and what it registers."""

from __future__ import annotations

import json

import click


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_command(as_json: bool) -> None:
    """List installed plugins, their versions and the names they register."""
    from toolkit.plugins import get_plugin_manager

    manager = get_plugin_manager()
    manager.collect_all()
    rows = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "module": p.module,
            "hooks": p.hooks,
            "registers": p.registered,
            "error": p.error,
        }
        for p in manager.plugins
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        status = f"  FAILED: {row['error']}" if row["error"] else ""
        click.echo(f"{row['name']}  ({row['distribution']} {row['version']}){status}")
        for kind, names in sorted(row["registers"].items()):
            click.echo(f"    {kind}: {', '.join(names)}")
