"""The training progress bar, with log records routed through it while it is shown.

tqdm redraws its bar with a carriage return and no newline, so a log record written to the same terminal in
between starts in the middle of the bar's line. While the bar is open, every logging handler of the "paddle_rl"
logger and of the root logger (and logging.lastResort) that writes to the terminal the bar draws on (the bar's
own stream, stdout or stderr) is swapped for a BarLogHandler: it formats the record as the handler would and
writes it with tqdm.write, which clears the bar, writes the line and redraws the bar under it. The original
handlers are back when the bar closes. Handlers writing elsewhere (files, pytest's capture) are left alone.
"""
import contextlib
import logging
import sys
from typing import List, Optional, Tuple

ROUTED_LOGGERS = ("paddle_rl", "")  # "" is the root logger


class BarLogHandler(logging.Handler):
    """Stands in for `inner` (a StreamHandler) while a bar is shown: same level, filters and formatting, the
    line written with `write` (tqdm.write) to inner's stream."""

    def __init__(self, inner: logging.StreamHandler, write):
        super().__init__(inner.level)
        self.inner = inner
        self.filters = inner.filters  # shared: a filter added to the original while the bar is open applies
        self._write = write

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.inner.format(record)
            self._write(message, file=self.inner.stream, end=getattr(self.inner, "terminator", "\n"))
            self.inner.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise into the caller
            self.handleError(record)


def _shares_terminal(handler, bar_file) -> bool:
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    stream = getattr(handler, "stream", None)
    return stream is not None and any(stream is s for s in (bar_file, sys.stdout, sys.stderr,
                                                              sys.__stdout__, sys.__stderr__))


def route_logging(bar_file, write) -> List[Tuple[Optional[logging.Logger], logging.Handler, logging.Handler]]:
    """Swaps the handlers that share the bar's terminal for BarLogHandlers; returns what restore_logging takes."""
    swapped = []
    for name in ROUTED_LOGGERS:
        logger = logging.getLogger(name)
        for i, handler in enumerate(list(logger.handlers)):
            if _shares_terminal(handler, bar_file):
                wrapper = BarLogHandler(handler, write)
                logger.handlers[i] = wrapper
                swapped.append((logger, handler, wrapper))
    last = logging.lastResort
    if last is not None and _shares_terminal(last, bar_file):
        logging.lastResort = BarLogHandler(last, write)
        swapped.append((None, last, logging.lastResort))
    return swapped


def restore_logging(swapped) -> None:
    """Puts the original handlers back where their BarLogHandlers are (handlers added meanwhile stay)."""
    for logger, handler, wrapper in reversed(swapped):
        if logger is None:
            if logging.lastResort is wrapper:
                logging.lastResort = handler
            continue
        for i, current in enumerate(logger.handlers):
            if current is wrapper:
                logger.handlers[i] = handler
                break


class Progress:
    """What progress_bar yields: update(summary) advances the bar one step and shows `summary` after it."""

    def __init__(self, bar=None):
        self.bar = bar

    def update(self, summary: str = "") -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        self.bar.set_postfix_str(summary)


@contextlib.contextmanager
def progress_bar(total: int, initial: int = 0, disabled: bool = False, file=None, desc: str = "rl"):
    """A tqdm bar of `total` steps (`initial` done) on `file` (default: stderr) with logging routed through it;
    yields a Progress. No bar (updates do nothing) when `disabled`, tqdm is not installed, or the stream is not a
    terminal."""
    if disabled:
        yield Progress()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield Progress()
        return
    bar_file = sys.stderr if file is None else file
    bar = tqdm(total=total, initial=initial, desc=desc, unit="step", disable=None, dynamic_ncols=True, file=bar_file)
    if bar.disable:  # not a terminal
        bar.close()
        yield Progress()
        return
    swapped = route_logging(bar_file, tqdm.write)
    try:
        yield Progress(bar)
    finally:
        try:
            bar.close()
        finally:
            restore_logging(swapped)
