"""Engine worker processes, one per device: one lifecycle (``pool.py``: spawn, ready handshake, heartbeat and
watchdog, death, restart, give-up, drain; ``process.py``: the child and how it is started) under two dispatch
policies: files with retries (``files.py``: ``DevicePool``, ``transcribe_files``; ``glmasr transcribe
--devices``) and the server's requests without retries (``requests.py``:
``DataParallelEngineClient``; ``glmasr serve --data-parallel N``)."""

from ..errors import WorkerStartError
from .files import DevicePool, FileResult, transcribe_files
from .pool import WorkerPool, parse_devices

__all__ = ["DevicePool", "FileResult", "WorkerPool", "WorkerStartError", "parse_devices", "transcribe_files"]
