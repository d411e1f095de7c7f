"""Straggler traces replayed at cluster scale (``malleus-sim replay`` / ``trace``): the trace
format and its reader (``trace.py``), traces drawn from published statistics
(``regimes.py``), the replay's policies (``run.py``) and what it prints and draws
(``output.py``)."""
