"""Standard streams that outlive their reader: a closed pipe (``toolkit sft ... | tee log`` ended by Ctrl-C,
a log reader that died) or a failing terminal must never end a training run at its next print.

Python raises BrokenPipeError at the first write after the reader went away; once that happens the
stream's file descriptor is pointed at /dev/null (what the Python docs advise for SIGPIPE), so later
writes and the interpreter's final flush are silent, and the run goes on to save its checkpoint.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class SurvivingStream:
    """Wraps a text stream; writes after the reader is gone are dropped instead of raising."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # EPIPE, EIO of a vanished terminal, "I/O operation on closed file"
                self._lose()
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        try:
            fd = self._stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)  # the buffered bytes still in the stream now go nowhere, at exit too
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_standard_streams() -> None:
    """Replace ``sys.stdout`` and ``sys.stderr`` with surviving wrappers (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SurvivingStream):
            setattr(sys, name, SurvivingStream(stream))
