"""Helpers the tests share. No test module imports another (tests/test_layout.py)."""
