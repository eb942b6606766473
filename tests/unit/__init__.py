"""Unit tests of xladist's pure pieces (no strategy, no XLA compile; milliseconds each),
laid out as the package is. A package, so that its modules' names cannot collide with
same-named test modules elsewhere in tests/."""
