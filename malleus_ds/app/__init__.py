"""The application at the edge: Hydra configs parsed into a typed run config (``config.py``, its
sections in ``config_sections.py`` and ``config_deepspeed.py``, the schema in ``run_config.py``;
``config_reference.py`` writes docs/configuration.md from the schema), the runners that train
under DeepSpeed, MalleusEngine or plain torch (``app/runners/``), ``malleus_ds.initialize``
(``api.py``), the ``malleus-plan`` / ``malleus-sim`` command lines (``cli.py``), the
single-process reference run (``reference.py``) and the device choice (``device.py``).
"""
