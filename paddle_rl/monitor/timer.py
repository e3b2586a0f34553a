import time
from contextlib import contextmanager


class StageTimer:
    """Seconds spent per named stage of a step (`time/<stage>`); `on_stage(name)` is told of each stage entered."""

    def __init__(self, on_stage=None):
        self.seconds = {}
        self.on_stage = on_stage

    @contextmanager
    def stage(self, name: str):
        if self.on_stage is not None:
            self.on_stage(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {f"time/{k}": v for k, v in self.seconds.items()}
