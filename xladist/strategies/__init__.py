"""The strategies: one module each."""
