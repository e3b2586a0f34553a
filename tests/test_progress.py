"""The progress bar and log lines on one terminal: each log line starts a line of its own."""
import io
import logging
import sys

import pytest

from micro_model import micro_overrides
from paddle_rl.config import load_config
from paddle_rl.monitor.progress import BarLogHandler, progress_bar


class FakeTerminal(io.StringIO):
    """Collects what is written; tqdm draws on it as on a terminal."""

    def isatty(self):
        return True


def screen_lines(text: str) -> list:
    """The lines a terminal shows for `text`: a carriage return moves back to the line's start, later characters
    overwrite earlier ones."""
    lines = []
    for raw in text.split("\n"):
        cells, col = [], 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            if col < len(cells):
                cells[col] = ch
            else:
                cells.append(ch)
            col += 1
        lines.append("".join(cells).rstrip())
    return lines


def log_lines_start_their_line(text: str, marker: str = "LOG ") -> list:
    """The shown lines holding a log record; asserts each begins with it (no bar text before it)."""
    shown = [line for line in screen_lines(text) if marker in line]
    for line in shown:
        assert line.startswith(marker), f"a log record after other text on its line: {line!r}\n{text!r}"
    return shown


@pytest.fixture
def paddle_rl_logger():
    logger = logging.getLogger("paddle_rl")
    level, handlers = logger.level, list(logger.handlers)
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_log_records_go_through_the_bar_and_handlers_come_back(paddle_rl_logger):
    terminal, elsewhere = FakeTerminal(), io.StringIO()
    on_terminal, in_file = logging.StreamHandler(terminal), logging.StreamHandler(elsewhere)
    for handler in (on_terminal, in_file):
        handler.setFormatter(logging.Formatter("LOG %(message)s"))
        paddle_rl_logger.addHandler(handler)
    with progress_bar(3, file=terminal) as progress:
        # the handler on the bar's terminal writes through the bar; the one writing elsewhere is left alone
        assert [type(h) for h in paddle_rl_logger.handlers] == [BarLogHandler, logging.StreamHandler]
        for step in range(1, 4):
            progress.update(f"reward/mean={step}")
            paddle_rl_logger.info("step %d/3", step)
    assert paddle_rl_logger.handlers == [on_terminal, in_file]
    text = terminal.getvalue()
    assert log_lines_start_their_line(text) == ["LOG step 1/3", "LOG step 2/3", "LOG step 3/3"]
    assert "rl: 100%" in text and "3/3" in text and "reward/mean=3" in text
    assert elsewhere.getvalue() == "LOG step 1/3\nLOG step 2/3\nLOG step 3/3\n"
    # after the bar, records go straight to the stream again
    paddle_rl_logger.info("after")
    assert terminal.getvalue().endswith("LOG after\n")


def test_no_bar_no_routing(paddle_rl_logger):
    terminal = FakeTerminal()
    handler = logging.StreamHandler(terminal)
    paddle_rl_logger.addHandler(handler)
    for kwargs in ({"disabled": True, "file": terminal}, {"file": io.StringIO()}):  # off, or not a terminal
        with progress_bar(3, **kwargs) as progress:
            assert paddle_rl_logger.handlers[-1] is handler
            progress.update("x")
    assert terminal.getvalue() == ""


def test_training_log_lines_do_not_land_on_the_bar(micro, tmp_path, monkeypatch, paddle_rl_logger):
    """RLTrainer.train draws its bar on stderr while logging the step summary every logging_steps steps."""
    from paddle_rl.trainer import RLTrainer
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(sys.stderr)  # what logging.basicConfig installs on the root (run_rl.py)
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        overrides = micro_overrides(micro, str(tmp_path), max_steps=3, logging_steps=2, do_eval=False,
                                    report_to="none", disable_tqdm=False)
        RLTrainer(load_config(None, overrides)).train()
        assert root.handlers[-1] is handler
    finally:
        root.removeHandler(handler)
    text = terminal.getvalue()
    shown = log_lines_start_their_line(text)
    assert [line for line in shown if line.startswith("LOG step ")] == [
        line for line in shown if line.startswith("LOG step 2/3 ")]  # every logging_steps only
    assert len([line for line in shown if line.startswith("LOG step 2/3 ")]) == 1
    assert "rl: 100%" in text and "3/3" in text
