import time
from contextlib import contextmanager

from . import memory


class StageTimer:
    """Seconds spent per named stage of a step (`time/<stage>`) and the peak resident memory reached in each
    (`memory/<stage>_peak_rss_mb`, monitor/memory.py; `memory/before_step_peak_rss_mb`: the peak between the
    previous step's last stage and this step's first, the model builds included on the first step);
    `on_stage(name)` is told of each stage entered."""

    def __init__(self, on_stage=None):
        self.seconds = {}
        self.peaks = {"before_step": memory.checkpoint()}
        self.open = []
        self.on_stage = on_stage

    def _fold(self) -> None:
        hwm = memory.checkpoint()
        for name in self.open:
            self.peaks[name] = max(self.peaks.get(name, 0.0), hwm)

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

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.seconds.items()},
                **{f"memory/{k}_peak_rss_mb": v for k, v in self.peaks.items()}}
