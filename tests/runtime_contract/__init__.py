"""The runtime contract's tests (a package: its conftest must not shadow tests/conftest.py,
which other test modules import as `conftest`)."""
