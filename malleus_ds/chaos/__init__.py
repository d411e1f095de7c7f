"""A fault campaign: a real multi-rank job under faults drawn from a seed, and the invariants
it must keep (``schedule.py`` the faults, ``inject.py`` doing them, ``run.py`` one run,
``verdict.py`` the invariants, ``cli.py`` ``malleus-chaos``)."""
