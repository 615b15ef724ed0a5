"""Several devices on one machine: one engine process per device, files handed out as workers have room,
crashed workers' files retried elsewhere (``pool.py``). ``glmasr transcribe --devices`` uses it."""

from .pool import DevicePool, FileResult, WorkerStartError, parse_devices, transcribe_files

__all__ = ["DevicePool", "FileResult", "WorkerStartError", "parse_devices", "transcribe_files"]
