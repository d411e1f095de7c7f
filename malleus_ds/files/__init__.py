"""What Malleus writes and reads on disk, safely: atomic writes and fsync'd renames
(``fileio.py``), loading that never unpickles code (``safe_load.py``), the checkpoint format that
loads under any plan and world size (``ckpt_format.py``), and a run folder's layout
(``run_folder.py``).
"""
