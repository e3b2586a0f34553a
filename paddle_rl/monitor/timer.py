import time
from contextlib import contextmanager


class StageTimer:
    """Seconds spent per named stage of a step (`time/<stage>`)."""

    def __init__(self):
        self.seconds = {}

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {f"time/{k}": v for k, v in self.seconds.items()}
