"""Slowing a rank on purpose, for tests, benches and demos: the straggler schedule and its sleep
emulation (``straggler.py``), and two real slowdowns from the OS: a cgroup CPU quota
(``cpu_quota.py``) and competing busy processes pinned to the rank's core (``cpu_compete.py``).
"""
