"""The one error family the CLI prints for people: what went wrong, the value, what to do."""

from __future__ import annotations


class ToolkitError(Exception):
    """An error a user can act on; the CLI prints it without a traceback (``--debug`` shows it)."""


class ConfigError(ToolkitError):
    """A recipe, flag or option is wrong; carries every problem found in one validation pass."""

    def __init__(self, problems: list[str] | str, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"invalid configuration in {source}" if source else "invalid configuration"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}" if len(self.problems) > 1 or source else self.problems[0])


class RegistryError(ToolkitError):
    """An unknown or duplicate registered name."""


class PluginLoadError(ToolkitError):
    """A plugin failed to import or register."""


class DataError(ToolkitError):
    """A dataset file or record is malformed (names the file and line)."""


class ModelError(ToolkitError):
    """A model reference cannot be loaded (missing weights, unsupported architecture...)."""


class LayoutError(ToolkitError):
    """A parallel layout that cannot work; the message shows the arithmetic."""


EXIT_STOPPED = 75
"""Exit status of a run stopped before its last step with a whole checkpoint (a signal, ``--stop-after``):
resumable with ``--resume auto``. 75 is EX_TEMPFAIL of sysexits.h: "try again later"."""


class RunStopped(ToolkitError):
    """Training stopped early and saved: not a failure, not finished either (exit status 75)."""

    exit_code = EXIT_STOPPED
