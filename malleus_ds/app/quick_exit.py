"""End the app's process without the interpreter's teardown.

A training process holds torch, DeepSpeed, Triton and the model: at a normal exit Python then
destroys every module and object one by one, which takes 1-3 s per process (more with several
ranks on few cores) after the run is over, and lets Triton's nanobind print leak warnings.
:func:`exit_quickly` does what a normal exit does that anyone can see -- it waits for the
non-daemon threads, runs the ``atexit`` handlers (logging's flush, multiprocessing's child
joins, those of monitors and of our CPU-quota cgroups), flushes stdout and stderr -- and then
ends the process with ``os._exit``, skipping only the object-by-object teardown. Daemon threads
end with the process, as they do at a normal exit.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_code(code: object) -> int:
    """The status Python gives ``SystemExit(code)``: None is 0, an int is itself, anything else
    is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    print(code, file=sys.stderr)
    return 1


def exit_quickly(code: object = 0) -> NoReturn:
    """Exit with ``code`` (as ``sys.exit`` takes it) as Python would, without its teardown."""
    status = exit_code(code)
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t.is_alive():
            t.join()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken pipe: nothing left to say
                pass
        os._exit(status)
