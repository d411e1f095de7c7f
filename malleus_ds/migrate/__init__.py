"""Live migration (DESIGN.md §6): transfer plan (pure) -> pack -> transport -> apply.

``transfer.py`` decides who sends what (no torch); ``rounds.py`` orders the messages into
bounded, deadlock-free rounds (no torch); ``transport.py`` moves packed buffers with batched
isend/irecv; ``apply.py`` reads and writes engine buffers by slice; ``alias.py`` finds the
optimizer ranges that stay in memory the rank already has (pure).
"""
