"""Unit tests of xladist/_step/ (hyper.py, hyper_inputs.py, seeds.py, signature.py)."""
