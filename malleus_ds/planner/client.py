"""Rank 0's side of the planner process (``planner/worker.py``): one JSON request per line on
its stdin, one answer per line on its stdout, read by a thread so training never waits on the
pipe. The adaptive loop (``malleus_ds/adaptive/control.py``) owns one."""
from __future__ import annotations

import threading


class PlannerClient:
    """Rank 0's planner process (``planner/worker.py``): :meth:`request` sends a problem,
    :meth:`poll` / :meth:`wait` return the answer; a reader thread only waits on the pipe."""

    def __init__(self) -> None:
        import os
        import queue
        import subprocess
        import sys
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])      # the checkout holding malleus_ds/
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-m", "malleus_ds.planner.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="malleus-planner-reader", daemon=True).start()

    def _read(self) -> None:
        import json

        for line in self.proc.stdout:
            try:
                self.answers.put(json.loads(line))
            except ValueError:
                self.answers.put({"error": f"planner worker wrote {line[:200]!r}"})
        self.answers.put({"error": f"the planner worker exited (code {self.proc.wait()})"})

    def request(self, req: dict) -> None:
        import json

        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.answers.put({"error": f"the planner worker is gone: {e}"})

    def poll(self) -> dict | None:
        import queue
        try:
            return self.answers.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout_s: float) -> dict:
        import queue
        try:
            return self.answers.get(timeout=timeout_s)
        except queue.Empty:
            return {"error": f"the planner did not answer within {timeout_s:g} s"}

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:       # noqa: BLE001 - best effort at shutdown
            self.proc.kill()
