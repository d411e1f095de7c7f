"""The adaptive loop: the work a rank does and its held ranks (``work.py``, ``held.py``),
measured straggling rates (``rates.py``), when a rate shift calls for a re-plan (``detect.py``),
when a rank probes and within what budget (``probing.py``, ``probe.py``), the links' rates and
their detection (``link_watch.py``, ``link_rates.py``), the job's planning problem and the
re-plan rule (``replan.py``), rank 0's planner session (``session.py``), the check of each
plan's promise against the pace the job then runs at and the back-out (``pace_check.py``,
``promise.py``), and the controller that implements the step hooks (``control.py``, with
``view.py``: what its components read of it).
"""
