"""The ``malleus`` section of a ds_config (``malleus.*`` in the app's config): one section, read
through three typed views, each a frozen dataclass whose fields are its keys and defaults:

* the engine's, ``engine/settings.MalleusSettings`` (the plan, the job's shape, the seed, the
  scripted switches, the migration limits); it passes the loop's keys over untouched;
* the adaptive loop's, ``adaptive/settings.AdaptiveSettings`` (``adaptive``, ``detect``,
  ``check``, ``horizon_steps``, ...);
* the app's, ``app/run_config.MalleusConfig``: the switches and migration limits, and the loop's
  view as its ``loop`` field.

A view's key list is derived from its fields (:func:`section_keys`), in field order: a field
whose key differs from its name says so in its metadata (:data:`KEY`), and a field set from
elsewhere than the section (the precision, from the ``fp16`` / ``bf16`` sections) has key None.
"""
from __future__ import annotations

from dataclasses import fields

#: the metadata entry naming a field's key in the section (None: not a key of the section)
KEY = "malleus_key"


def section_keys(cls) -> tuple[str, ...]:
    """The section's keys that dataclass ``cls`` reads, in field order (module doc)."""
    out = []
    for f in fields(cls):
        key = f.metadata.get(KEY, f.name)
        if key is not None:
            out.append(key)
    return tuple(out)
