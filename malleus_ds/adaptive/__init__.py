"""The adaptive loop: measured straggling rates (``straggler.py``), probes of ranks without
work or held on a light share (``probe.py``), the job's planning problem and the re-plan rule
(``replan.py``), the check of each plan's promise against the pace the job then runs at
(``pace_check.py``), the measured TP slowdown table (``tp_cost.py``), and the controller that
runs them every step (``control.py``).
"""
