"""The test kit: helper modules the tests share (fixtures are in tests/conftest.py)."""
