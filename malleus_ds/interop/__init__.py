"""DeepSpeed's formats, read and written without an engine:

* the ds_config, decoded once per rank into a frozen value (:mod:`.ds_config`): what
  MalleusEngine does with each key (:mod:`.config_keys`), the sections it decodes itself
  (:mod:`.sections`), the batch keys (:mod:`.batch`), ``"auto"`` filled as the Hugging Face
  Trainer fills it (:mod:`.auto`); its ``malleus`` section's typed home: the adaptive loop's
  settings, and the section's key lists derived from the dataclasses that read it
  (:mod:`.malleus_section`);
* DeepSpeed checkpoints in (:mod:`.checkpoint` and its ``checkpoint_*`` readers, converted to
  MalleusEngine's format by :mod:`.checkpoint_import`) and out (:mod:`.universal`);
* the one parameter naming, ours <-> DeepSpeed PipelineModule <-> Hugging Face (:mod:`.names`);
* the patches that let stock DeepSpeed's runtime run here (:mod:`.compat`).

Below the engine and the adaptive loop: nothing here imports ``engine/`` or ``adaptive/``.
Importing the package is light; DeepSpeed is imported inside the functions that need it.
"""
