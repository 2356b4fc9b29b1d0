"""A progress bar on stderr: tqdm when installed, else a small one of ours.

Both are silent when `enabled` is False, so tests and `--quiet` runs print nothing. Ours redraws
one line with a carriage return on a terminal and prints a line per update (at most one
every 5 seconds) when stderr is a file, so a log stays readable.
"""

from __future__ import annotations

import sys
import time


class _PlainBar:
    def __init__(self, total: int, desc: str, stream, min_interval_s: float = 5.0):
        self.total = max(int(total), 1)
        self.desc = desc
        self.stream = stream
        self.n = 0
        self.postfix = ""
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._min_interval_s = min_interval_s
        self._tty = bool(getattr(stream, "isatty", lambda: False)())

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        self._draw()

    def update(self, n: int = 1) -> None:
        self.n = min(self.n + n, self.total)
        self._draw(force=self.n == self.total)

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_draw < (0.1 if self._tty else self._min_interval_s):
            return
        self._last_draw = now
        width = 24
        filled = int(width * self.n / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"{self.desc} [{bar}] {self.n}/{self.total} {now - self.start:5.1f}s {self.postfix}"
        if self._tty:
            self.stream.write("\r" + line.ljust(100)[:100])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


class _NullBar:
    def set_postfix_str(self, text: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """Context manager: `with Progress(total, "speed") as bar: bar.update()`."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, stream=None, use_tqdm: bool = True):
        stream = stream if stream is not None else sys.stderr
        if not enabled:
            self._bar = _NullBar()
        elif use_tqdm and _tqdm_available():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=stream, leave=True, dynamic_ncols=True)
        else:
            self._bar = _PlainBar(total, desc, stream)

    def __enter__(self):
        return self._bar

    def __exit__(self, *exc):
        self._bar.close()
        return False


def _tqdm_available() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class Step:
    """Announce one step that may take over a second: prints `label ...` then `done in X s`
    on stderr, only when the step actually lasts longer than `min_s` (short steps stay quiet
    except for the label when printed on a terminal)."""

    def __init__(self, label: str, *, enabled: bool = True, stream=None, min_s: float = 1.0):
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.min_s = min_s
        self.elapsed = 0.0

    def __enter__(self):
        self.start = time.perf_counter()
        if self.enabled:
            self.stream.write(f"{self.label} ...\n")
            self.stream.flush()
        return self

    def __exit__(self, exc_type, *rest):
        self.elapsed = time.perf_counter() - self.start
        if self.enabled and exc_type is None and self.elapsed >= self.min_s:
            self.stream.write(f"  {self.label}: done in {self.elapsed:.1f} s\n")
            self.stream.flush()
        return False
