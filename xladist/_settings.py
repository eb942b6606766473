"""xladist's environment settings, read one way: a switch (on unless set to an
off word) and a whole number (a bad value raises, naming the variable)."""

import os

OFF_WORDS = ("0", "off", "false", "no")


def text(name):
  """The variable's value, stripped ("" when unset)."""
  return os.environ.get(name, "").strip()


def switch(name, default):
  """Whether `name` is on: `default` when unset or empty, off for 0/off/false/no."""
  value = text(name).lower()
  if not value:
    return default
  return value not in OFF_WORDS


def whole_number(name, default, meaning):
  """(`name` as an int, True) when set, else (`default`, False).

  Raises:
    ValueError: the variable is set to something that is not a whole number;
      the message names it and says what it means (`meaning`).
  """
  value = text(name)
  if not value:
    return default, False
  try:
    return int(value), True
  except ValueError:
    raise ValueError(f"{name} must be an int ({meaning}), got {value!r}.") from None
