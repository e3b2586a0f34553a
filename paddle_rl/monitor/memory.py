"""Peak resident memory (RSS) per stage of a step, from the kernel's own high-water mark.

Paddle's CPU allocator is invisible to tracemalloc, so the stages are measured as the process sees them: at each
stage boundary the high-water mark (VmHWM in /proc/self/status) is read, folded into every open stage and the
process's peak, and reset (writing 5 to /proc/self/clear_refs, Linux >= 4.0). Each stage's peak is then exact,
transient buffers included. Where /proc cannot be written (not Linux, a locked-down /proc) nothing is reset: every
stage reads the process's peak so far, and `per_stage()` says so.

A reset lowers what getrusage(RUSAGE_SELF).ru_maxrss reports afterwards: read the process's peak from
`process_peak_mb()`, which is never below it.

Beside them, the page faults taken in each stage (`page_faults`, getrusage's minor faults): each is a page of memory
touched for the first time since the process got it, which the kernel zeroes on the spot. A stage that grows the heap
pays them (the first update of a run; later ones where freed memory no longer fits the next step's blocks); on a
virtual machine one can cost several microseconds of system time.

Beside the RSS, the peak of the bytes Paddle's CPU allocator has handed out to live tensors (its host memory
statistic "Allocated", reset at the same boundaries): the RSS minus it is the rest (the Python heap, libraries,
memory the allocator or malloc holds but no tensor uses).
"""
import resource
import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_state = {"peak_mb": 0.0, "resettable": None}


def _status_mb(field: str) -> float:
    """A `kB` line of /proc/self/status in MB (0.0 where it cannot be read)."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rss_mb() -> float:
    """The resident memory now (VmRSS), MB."""
    return _status_mb("VmRSS")


def _reset() -> bool:
    if _state["resettable"] is False:
        return False
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        _state["resettable"] = True
    except OSError:
        _state["resettable"] = False
    return _state["resettable"]


def per_stage() -> bool:
    """Whether the stages' peaks are their own (the high-water mark can be reset here)."""
    return _state["resettable"] is not False


def _tensor_peak_mb(reset: bool) -> float:
    """Paddle's CPU allocator's peak of bytes in live tensors since the last reset (MB); 0.0 before Paddle is
    loaded (read from sys.modules: this module never loads Paddle itself)."""
    paddle = sys.modules.get("paddle")
    if paddle is None:
        return 0.0
    core = paddle.base.core
    peak = core.host_memory_stat_peak_value("Allocated", 0) / 2**20
    if reset:
        core.host_memory_stat_reset_peak_value("Allocated", 0)
    return peak


def checkpoint() -> tuple:
    """(RSS, tensor bytes): the high-water marks since the last checkpoint (MB), the RSS's folded into the
    process's peak; then both reset."""
    hwm = max(_status_mb("VmHWM"), rss_mb())
    _state["peak_mb"] = max(_state["peak_mb"], hwm)
    _reset()
    return hwm, _tensor_peak_mb(reset=True)


def page_faults() -> int:
    """The process's minor page faults so far (getrusage: every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def process_peak_mb() -> float:
    """The process's peak RSS (MB) despite the resets: the largest high-water mark seen, and ru_maxrss."""
    checkpoint()
    return max(_state["peak_mb"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
