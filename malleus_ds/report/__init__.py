"""What a run did, read back from its folder: metrics.jsonl's format and reader
(``metrics.py``), the one model of a run every report reads it through (``run_model.py``: its
ranks, its stretches of one emulated condition, its throughput with migrations), straggler
phases as the loop reads rates (``phases.py``), the loop's plan
checks (``check_events.py``), the what-if account (``whatif.py``; its rates and slow links
``whatif_rates.py``, the static plan and the bounds ``whatif_static.py``), DeepSpeed-vs-Malleus
side by side (``compare.py``), the plots (``plot.py``, ``plot_data.py``) and where run folders are
(``run_folder.py``).
"""
