"""The process plumbing every engine-per-device worker shares: the offline ``DevicePool`` (``pool.py``) and the
server's data-parallel engine workers (``glmasr.server.data_parallel``).

- ``start_worker``: a ``spawn`` process with one pipe per direction (the parent keeps the ends it uses and closes
  the child's, so a child that dies is seen at once as EOF on its pipe); a CUDA worker is started with
  ``CUDA_VISIBLE_DEVICES`` naming its GPU (mapped through the parent's own ``CUDA_VISIBLE_DEVICES``), so it sees
  only ``cuda:0`` from its first CUDA call on.
- ``load_model`` (in the child): torch threads and audio threads set, then ``glmasr.load`` on the child's device.
- ``describe_exit``: an exit status as words ("killed by SIGKILL", "exit status 70").
- ``cores``: the CPUs this process may use (to split them between CPU workers).
"""

from __future__ import annotations

import os
import signal
import threading

_ENV_LOCK = threading.Lock()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def child_device(device: str) -> tuple[str, str | None]:
    """A device as the parent names it -> (the device as the child sees it, its ``CUDA_VISIBLE_DEVICES`` or None).
    ``cuda:1`` -> ("cuda:0", "1"), or the parent's own visible id at position 1; ``cpu`` -> ("cpu", None)."""
    if not device.startswith("cuda"):
        return device, None
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else None
    return "cuda:0", ids[index] if ids is not None and index < len(ids) else str(index)


def start_worker(ctx, target, device: str, make_args, name: str):
    """Start ``target(*make_args(child_device), to_child_reader, from_child_writer)`` in a ``ctx`` (spawn) process
    for ``device``. Returns ``(process, to_child, from_child)``: the parent's ends of the two pipes."""
    to_child_r, to_child_w = ctx.Pipe(duplex=False)
    from_child_r, from_child_w = ctx.Pipe(duplex=False)
    dev, visible = child_device(device)
    p = ctx.Process(target=target, args=(*make_args(dev), to_child_r, from_child_w), daemon=True, name=name)
    with _ENV_LOCK:  # the child inherits the environment at exec: it sees only its GPU from the start
        old = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            if visible is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
            p.start()
        finally:
            if visible is not None:
                if old is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = old
    to_child_r.close()
    from_child_w.close()
    return p, to_child_w, from_child_r


def load_model(device: str, model: str, dtype: str | None, engine_options: dict, threads: int):
    """In a worker: ``threads`` torch (and audio decoding) threads, then the model loaded on ``device``."""
    import torch

    import glmasr
    from glmasr import audio as audio_mod

    torch.set_num_threads(threads)
    audio_mod.AUDIO_THREADS = threads  # decoding/resampling threads of one long file
    return glmasr.load(model, device=device, dtype=dtype, **engine_options)
