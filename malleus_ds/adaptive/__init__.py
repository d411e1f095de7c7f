"""The adaptive loop: the work a rank does (``work.py``), measured straggling rates (``rates.py``), when a rate shift
calls for a re-plan (``detect.py``), which ranks are held and who calibrates their probes
(``held.py``), probes of ranks without
work or held on a light share (``probe.py``), the job's planning problem and the re-plan rule
(``replan.py``), the check of each plan's promise against the pace the job then runs at
(``pace_check.py``), the measured TP slowdown table (``tp_cost.py``), and the controller that
runs them every step (``control.py``).
"""
