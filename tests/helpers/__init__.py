"""Test-only helpers shared by the model tests (imported as ``helpers.*``; ``tests/`` is on sys.path
through its conftest)."""
