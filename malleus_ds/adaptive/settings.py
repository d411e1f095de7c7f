"""The adaptive loop's settings: the ``malleus.*`` keys of the loop (``adaptive``, ``detect``,
``check``, ``horizon_steps``, ...), parsed once into a frozen :class:`AdaptiveSettings`.

Defined in ``interop/malleus_section.py``, the ``malleus`` section's one typed home, below both
the loop and the engine: the engine accepts the loop's keys (:data:`ADAPTIVE_KEYS`) from there
and leaves them to the loop. Re-exported here, the loop's name for them.
"""
from __future__ import annotations

from ..interop.malleus_section import (ADAPTIVE_KEYS, AdaptiveSettings,  # noqa: F401  (re-exported)
                                       CheckConfig, DetectConfig)
