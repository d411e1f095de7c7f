"""exit_quickly: what a normal exit does that anyone can see (non-daemon threads joined, atexit
handlers run, buffered output flushed, the status) without the interpreter's teardown."""
import subprocess
import sys
import textwrap

import pytest

from malleus_ds.app.quick_exit import exit_code

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading, time
    from malleus_ds.app.quick_exit import exit_quickly

    class Loud:
        def __del__(self):          # teardown would run this; a quick exit does not
            print("torn down", flush=True)

    keep = Loud()
    atexit.register(lambda: print("atexit ran"))
    def late():
        time.sleep(0.2)
        print("thread finished")
    threading.Thread(target=late).start()
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    sys.stdout.write("buffered, no newline")
    exit_quickly(CODE)
""")


@pytest.mark.parametrize("code,status", [(None, 0), (0, 0), (3, 3), ("a message", 1)])
def test_exit_quickly_joins_threads_runs_atexit_and_flushes(code, status):
    p = subprocess.run([sys.executable, "-c", PROGRAM.replace("CODE", repr(code))],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == status, p.stderr
    out = p.stdout
    assert "buffered, no newline" in out
    assert out.index("thread finished") < out.index("atexit ran")   # as a normal exit orders them
    assert "torn down" not in out
    assert ("a message" in p.stderr) == (code == "a message")


def test_exit_code_is_pythons():
    assert [exit_code(c) for c in (None, 0, 2, True)] == [0, 0, 2, 1]
