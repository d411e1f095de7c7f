"""What a run did, read back from its folder: metrics.jsonl's format and reader
(``metrics.py``), straggler phases as the loop reads rates (``phases.py``), the loop's plan
checks (``check_events.py``), the what-if account (``whatif.py``), DeepSpeed-vs-Malleus side by
side (``compare.py``), the plots (``plot.py``, ``plot_data.py``) and where run folders are
(``run_folder.py``).
"""
