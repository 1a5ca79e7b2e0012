"""Example factories for ``wbdebug check --factory`` (run from the repository root)."""
