"""The step: one `strategy.run` traced into one program (see engine.py)."""
