"""Several devices on one machine for files (``glmasr transcribe --devices``): a re-export of the files policy of
``glmasr.workers`` (``workers/files.py``), kept as the public import path."""

from ..workers.files import DevicePool, FileResult, WorkerStartError, parse_devices, transcribe_files

__all__ = ["DevicePool", "FileResult", "WorkerStartError", "parse_devices", "transcribe_files"]
