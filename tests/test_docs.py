"""The docs say what the code does: README tables, .env.example and CI are checked against the source."""

from __future__ import annotations

import shutil
from pathlib import Path

import wbdebug
from wbdebug import EventKind, keys

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    assert "make demo" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_documents_every_event_kind_and_metric_key():
    for kind in EventKind:
        assert f"`{kind.value}`" in README, kind
    for key, _ in keys.KEY_TABLE:
        assert f"`{key}`" in README, key


def test_env_example_lists_every_setting_with_its_default(tmp_path, monkeypatch):
    text = (ROOT / ".env.example").read_text()
    for name, field in wbdebug.Config.model_fields.items():
        assert f"WBDEBUG_{name.upper()}=" in text, name
        assert field.description, f"{name} needs a description"
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    monkeypatch.chdir(tmp_path)
    assert wbdebug.Config() == wbdebug.Config(_env_file=None)
