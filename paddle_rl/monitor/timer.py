import time
from contextlib import contextmanager

from . import memory


class StageTimer:
    """Seconds spent per named stage of a step (`time/<stage>`) and the peaks of memory reached in each
    (monitor/memory.py): the resident memory `memory/<stage>_peak_rss_mb` and Paddle's live tensors
    `memory/<stage>_peak_tensor_mb` (`before_step`: between the previous step's last stage and this step's first,
    the model builds included on the first step), and the page faults taken in each `memory/<stage>_page_faults`
    (not before_step's); `on_stage(name)` is told of each stage entered."""

    def __init__(self, on_stage=None):
        self.seconds = {}
        rss, tensors = memory.checkpoint()
        self.peaks = {"before_step": (rss, tensors)}
        self.faults, self.faults_at = {}, memory.page_faults()
        self.open = []
        self.on_stage = on_stage

    def _fold(self) -> None:
        rss, tensors = memory.checkpoint()
        now = memory.page_faults()
        faults, self.faults_at = now - self.faults_at, now
        for name in self.open:
            old = self.peaks.get(name, (0.0, 0.0))
            self.peaks[name] = (max(old[0], rss), max(old[1], tensors))
            self.faults[name] = self.faults.get(name, 0) + faults

    @contextmanager
    def stage(self, name: str):
        if self.on_stage is not None:
            self.on_stage(name)
        self._fold()
        self.open.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self._fold()
            self.open.remove(name)

    @contextmanager
    def part(self, name: str):
        """A part of the open stage whose memory peaks are recorded on their own (`memory/<name>_peak_*`), not
        its time."""
        self._fold()
        self.open.append(name)
        try:
            yield
        finally:
            self._fold()
            self.open.remove(name)

    def metrics(self) -> dict:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        for name, (rss, tensors) in self.peaks.items():
            out[f"memory/{name}_peak_rss_mb"], out[f"memory/{name}_peak_tensor_mb"] = rss, tensors
        for name, count in self.faults.items():
            out[f"memory/{name}_page_faults"] = float(count)
        return out
