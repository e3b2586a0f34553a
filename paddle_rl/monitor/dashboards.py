"""The dashboards `report_to` names: VisualDL, TensorBoard event files (tensorboardX), Weights & Biases (offline).

A dashboard that is named but whose package cannot be imported stops the run with a ConfigError naming
`report_to` and the package; nothing is replaced by another dashboard. `all` opens every dashboard whose
package is installed (visualdl and tensorboardX are install requirements, wandb is not) and logs which.
"""
import importlib
import logging
import os
import time
from typing import Dict, List, Optional

from ..config.loader import ConfigError
from ..config.logging_args import DASHBOARDS, REPORT_TO_WORDS, report_to_words
from .completions import markdown, plain

logger = logging.getLogger("paddle_rl")

PACKAGES = {"visualdl": "visualdl", "tensorboard": "tensorboardX", "wandb": "wandb"}


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def resolve_dashboards(report_to) -> List[str]:
    """The dashboards to open; raises ConfigError for an unknown name or a named one whose package is missing."""
    words = report_to_words(report_to)
    unknown = [w for w in words if w not in REPORT_TO_WORDS]
    if unknown:
        raise ConfigError(f"report_to: {', '.join(map(repr, unknown))} not one of {', '.join(REPORT_TO_WORDS)}")
    if not words or words == ("none",):
        return []
    if words == ("all",):
        chosen = [name for name in DASHBOARDS if _importable(PACKAGES[name])]
        logger.info("report_to all: %s (the others' packages are not installed)", ", ".join(chosen))
        return chosen
    missing = [name for name in words if not _importable(PACKAGES[name])]
    if missing:
        packages = " ".join(PACKAGES[name] for name in missing)
        raise ConfigError(f"report_to: {', '.join(missing)} needs the Python package(s) {packages}, which cannot be "
                          f"imported; install them (pip install {packages}) or leave {', '.join(missing)} out of "
                          f"report_to")
    return list(dict.fromkeys(words))


class VisualDLDashboard:
    def __init__(self, logdir: str, run_name: Optional[str]):
        from visualdl import LogWriter
        self.writer = LogWriter(logdir=logdir, display_name=run_name or "")

    def add_scalars(self, step: int, scalars: Dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(tag=key, value=value, step=step)
        self.writer.flush()

    def add_table(self, step: int, tag: str, columns: List[str], rows: List[List[str]]) -> None:
        """A text entry: one block of `column: value` lines per row."""
        self.writer.add_text(tag=tag, text_string=plain(columns, rows), step=step)
        self.writer.flush()

    def restart(self, step: int) -> None:
        """VisualDL has no marker for a resumed run: its charts keep the interrupted run's later points."""

    def close(self) -> None:
        self.writer.close()


class TensorBoardDashboard:
    """One event file `events.out.tfevents.<time>.<host>.<pid>` in `logdir`, written with tensorboardX's
    synchronous EventsWriter: a step's scalars are on disk (fsync) when add_scalars returns. (tensorboardX's
    SummaryWriter hands events to a thread that writes them every flush_secs, and its flush() does not wait for
    them: a rank ended by the watchdog's os._exit would lose its last steps.) Tags are written as given."""

    def __init__(self, logdir: str, run_name: Optional[str]):
        # deferred like visualdl's: importing tensorboardX also imports torch when torch is installed (seconds)
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.plugin_text_pb2 import TextPluginData
        from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboardX.proto.tensor_pb2 import TensorProto
        from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
        self._event, self._session_log, self._summary = Event, SessionLog, Summary
        self._metadata, self._text_plugin_data, self._tensor, self._shape = (SummaryMetadata, TextPluginData,
                                                                             TensorProto, TensorShapeProto)
        self.writer = EventsWriter(os.path.join(logdir, "events"), filename_suffix=f".{os.getpid()}")
        self.writer.flush()  # the file-version event

    def add_scalars(self, step: int, scalars: Dict[str, float]) -> None:
        now = time.time()
        for key, value in scalars.items():
            summary = self._summary(value=[self._summary.Value(tag=key, simple_value=float(value))])
            self.writer.write_event(self._event(wall_time=now, step=step, summary=summary))
        self.writer.flush()

    def add_table(self, step: int, tag: str, columns: List[str], rows: List[List[str]]) -> None:
        """A text summary (TensorBoard's Text tab, plugin `text`) holding the table as Markdown, drawn as a table."""
        metadata = self._metadata(plugin_data=self._metadata.PluginData(
            plugin_name="text", content=self._text_plugin_data(version=0).SerializeToString()))
        tensor = self._tensor(dtype="DT_STRING", string_val=[markdown(columns, rows).encode("utf-8")],
                              tensor_shape=self._shape(dim=[self._shape.Dim(size=1)]))
        summary = self._summary(value=[self._summary.Value(tag=tag, metadata=metadata, tensor=tensor)])
        self.writer.write_event(self._event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def restart(self, step: int) -> None:
        """A SessionLog START at step + 1: TensorBoard drops the interrupted run's events of later steps."""
        start = self._session_log(status=self._session_log.START)
        self.writer.write_event(self._event(wall_time=time.time(), step=step + 1, session_log=start))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbDashboard:
    """A wandb run in offline mode (sync later with `wandb sync`); $WANDB_MODE and $WANDB_PROJECT override. `proxy`
    (wandb_http_proxy): the proxy of its http and https requests to the wandb server."""

    def __init__(self, logdir: str, run_name: Optional[str], proxy: str = ""):
        import wandb
        os.makedirs(logdir, exist_ok=True)
        self._wandb = wandb
        extra = {"settings": wandb.Settings(http_proxy=proxy, https_proxy=proxy)} if proxy else {}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "paddle_rl"), name=run_name, dir=logdir,
                              mode=os.environ.get("WANDB_MODE", "offline"), **extra)

    def add_scalars(self, step: int, scalars: Dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def add_table(self, step: int, tag: str, columns: List[str], rows: List[List[str]]) -> None:
        self.run.log({tag: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def restart(self, step: int) -> None:
        """A resumed run is a new wandb run; nothing to mark."""

    def close(self) -> None:
        self.run.finish()


OPENERS = {"visualdl": VisualDLDashboard, "tensorboard": TensorBoardDashboard, "wandb": WandbDashboard}


def open_dashboards(report_to, logdir: str, run_name: Optional[str], wandb_proxy: str = "") -> list:
    names = resolve_dashboards(report_to)
    if names:
        os.makedirs(logdir, exist_ok=True)
    if wandb_proxy and "wandb" not in names:
        logger.warning("wandb_http_proxy %s is not used: no wandb dashboard is written (report_to: %s)", wandb_proxy,
                       report_to)
    return [OPENERS[name](logdir, run_name, **({"proxy": wandb_proxy} if name == "wandb" and wandb_proxy else {}))
            for name in names]
