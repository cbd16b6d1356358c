"""The directories the web UI may read (runs, data) and write (runs): every path typed into the page
is resolved (symlinks followed) and checked against them before anything opens it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from toolkit.errors import ToolkitError

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
# What splits an option value into the pieces that may each name a file: a reward's
# "file.py:function:0.5", an adapter list "a=/dir,b=/dir", a mapping "key=value".
PIECES = re.compile(r"[:,=;]")


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

    def check_mentions(self, value: Any, what: str) -> None:
        """Refuse any path ``value`` names outside the readable directories.

        For options whose meaning the page cannot know (a plugin's reward ``file.py:function``,
        a DeepSpeed JSON, a LoRA directory, ...): every string in ``value`` (items of lists and
        mappings too), whole and split at ``: , = ;``, is taken as a path from the runs directory,
        where the run starts; one that resolves (symlinks followed) outside the directories is
        refused. A plain name ("answer", "q_proj", "eval/loss") resolves inside and passes; a
        ``file://`` URL is checked as its path, other URLs are not files.
        """
        if isinstance(value, dict):
            for key, item in value.items():
                self.check_mentions(key, what)
                self.check_mentions(item, what)
        elif isinstance(value, (list, tuple)):
            for item in value:
                self.check_mentions(item, what)
        elif isinstance(value, str) and value.strip():
            text = value.strip()
            url = URL.match(text)
            if url:
                if url.group(1).lower() == "file":
                    self.readable_path(url.group(2), what)
                return
            for piece in dict.fromkeys([text, *PIECES.split(text)]):
                if piece.strip():
                    self.readable_path(piece, what)

    def _inside(self, value: str | Path, what: str, roots: list[Path], flag: str) -> Path:
        if not str(value).strip():
            raise PathRefused(f"{what}: give a path")
        try:
            path = self.resolve(str(value).strip())
        except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, ~nobody: not a path the page can check
            raise PathRefused(f"{what}: {value!r} is not a usable path ({exc})") from None
        if any(path == root or path.is_relative_to(root) for root in roots):
            return path
        listed = ", ".join(str(r) for r in roots)
        raise PathRefused(f"{what}: {value} is outside the directories this web UI may use ({listed}); "
                          f"start 'toolkit webui' with {flag} to allow another one")
