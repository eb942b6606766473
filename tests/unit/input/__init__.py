"""Unit tests of xladist/input/ (sharding.py)."""
