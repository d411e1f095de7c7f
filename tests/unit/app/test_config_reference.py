"""docs/configuration.md is what ``malleus_ds.app.config_reference`` generates from the settings
dataclasses and conf/ (so the reference cannot drift from the code), and the generator reads
every field's type, default and doc comment."""
from __future__ import annotations

import dataclasses

from malleus_ds.app import config_reference as ref


def test_docs_configuration_is_generated_from_the_settings():
    assert ref.OUT.read_text() == ref.render(), (
        f"docs/configuration.md is out of date with the settings dataclasses or conf/: run "
        f"`{ref.COMMAND}` and commit the result")


def test_every_field_of_every_section_is_on_the_page():
    text = ref.render()
    for prefix, spec, _ in ref.SECTIONS:
        cls = ref._load(spec)
        assert f"## {ref._title(prefix, cls)}" in text
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} is not on the page"


def test_the_doc_comment_is_the_one_above_or_beside_the_field():
    from malleus_ds.app.run_config import CheckpointConfig, ParallelConfig

    docs = {name: doc for name, _, doc in ref._fields(CheckpointConfig)}
    assert docs["every"] == "save every N optimizer steps; 0 = only at the end"
    # a comment continued on the next lines, indented under the first
    assert docs["resume"].startswith("True: continue from") and docs["resume"].endswith(
        "else start fresh")
    above = {name: doc for name, _, doc in ref._fields(ParallelConfig)}["asked_pp"]
    assert above.startswith("the ``parallel.pp`` asked for") and above.endswith("None otherwise")


def test_config_groups_list_each_option_and_the_default():
    text = ref.render()
    assert "| `model` | `tiny` | yes |" in text
    assert "| `deepspeed` | `zero2` |  |" in text


def test_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert ref.main(["--check", "-o", str(stale)]) == 1
    assert ref.COMMAND in capsys.readouterr().err
    assert ref.main(["-o", str(stale)]) == 0
    assert ref.main(["--check", "-o", str(stale)]) == 0
