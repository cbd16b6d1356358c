"""The directories the web UI may read (runs, data) and write (runs): every path typed into the page
is resolved (symlinks followed) and checked against them before anything opens it."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import ToolkitError


class PathRefused(ToolkitError):
    """A path outside the directories ``toolkit webui`` was started with."""


class Roots:
    """``runs`` (read and write; relative paths start here) and ``data`` directories (read only)."""

    def __init__(self, runs: Path, data: list[Path] | tuple[Path, ...] = ()):
        self.runs = Path(runs).expanduser().resolve()
        self.data = [Path(d).expanduser().resolve() for d in data]

    @property
    def readable(self) -> list[Path]:
        return [self.runs, *self.data]

    def resolve(self, value: str | Path) -> Path:
        path = Path(value).expanduser()
        return (path if path.is_absolute() else self.runs / path).resolve()

    def readable_path(self, value: str | Path, what: str) -> Path:
        """``value`` as an absolute path inside a readable directory, or :class:`PathRefused`."""
        return self._inside(value, what, self.readable, "--data-dir DIR (repeatable) or --runs-dir DIR")

    def writable_path(self, value: str | Path, what: str) -> Path:
        """``value`` as an absolute path inside the runs directory, or :class:`PathRefused`."""
        return self._inside(value, what, [self.runs], "--runs-dir DIR")

    def _inside(self, value: str | Path, what: str, roots: list[Path], flag: str) -> Path:
        if not str(value).strip():
            raise PathRefused(f"{what}: give a path")
        path = self.resolve(str(value).strip())
        if any(path == root or path.is_relative_to(root) for root in roots):
            return path
        listed = ", ".join(str(r) for r in roots)
        raise PathRefused(f"{what}: {value} is outside the directories this web UI may use ({listed}); "
                          f"start 'toolkit webui' with {flag} to allow another one")
