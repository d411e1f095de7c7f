"""Keeping a job alive and its ranks in step: the hang watchdog with per-rank heartbeats
(``watchdog.py``), the agreement every rank reaches before a collective so bad input is one error
everywhere and never a hang (``agreement.py``), and process helpers: per-process resources,
process start times, session kills (``procs.py``).
"""
