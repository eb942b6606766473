"""A step signature's differences in words (signature.py): what `differences` and
`explain` say when a step compiles again (compile_watch.py) or is traced with a new key
(replay.py)."""

import re

_MISSING = object()
_SETS_MODES = "fn calls .train() or .eval()"


def _show(entry, sharding_changed=False):
  kind = entry[0]
  if kind == "tensor":
    shape, dtype, sharding = entry[1], entry[2], entry[3]
    text = f"tensor{list(shape)} {str(dtype).replace('torch.', '')}"
    if sharding == "{replicated}":
      text += " replicated" if sharding_changed else ""
    elif sharding:
      text += f" sharded {sharding}"
    if len(entry) > 4:
      text += "" if entry[4] else " (requires_grad=False)"
      text += " with a .grad" if entry[5] is not None else ""
    return text
  if kind == "value":
    return repr(entry[1])
  if kind == "hyper":
    return repr(entry[1])
  if kind == "PerReplica" and entry[1] and entry[1][0] == "tensor":
    return f"PerReplica of {_show(entry[1], sharding_changed)}"
  if kind in ("PerReplica", "Mirrored", "SyncOnRead") or kind.endswith("Values"):
    shown = [_show(e, sharding_changed) for e in entry[1]]
    if len(set(shown)) == 1:
      return f"{kind} of {len(shown)} x {shown[0]}"
    return f"{kind} of " + ", ".join(shown)
  if kind == "function":
    return entry[1]
  if kind == "pending":
    if entry[1] is None:
      return "device data only"
    if entry[1] == "unsynced":
      return "not checked (no torch_xla.sync() since the step before)"
    return "work traced and not executed yet (it joins the step's program)"
  return f"a {entry[1]}"


def _tensor_entries(entry):
  """The tensor entries inside an entry (a distributed value's components)."""
  if entry[0] == "tensor":
    return [entry]
  if isinstance(entry[1], tuple) and entry[1] and isinstance(entry[1][0], tuple):
    return [t for e in entry[1] for t in _tensor_entries(e)]
  if isinstance(entry[1], tuple) and entry[1] and entry[1][0] == "tensor":
    return [entry[1]]
  return []


def _what_changed(old, new):
  """Which part of an entry changed, in words (shape, dtype, sharding...)."""
  if old[0] == new[0] and old[0] != "tensor":
    a, b = _tensor_entries(old), _tensor_entries(new)
    if a and len(a) == len(b):
      words = {_what_changed(x, y) for x, y in zip(a, b) if x != y}
      if words and "kind" not in words:
        return " and ".join(sorted(words))
  if old[0] == new[0] == "tensor":
    parts = []
    for i, word in (
      (1, "shape"),
      (2, "dtype"),
      (3, "sharding"),
      (4, "requires_grad"),
      (5, "grad"),
    ):
      if i < len(old) and i < len(new) and old[i] != new[i]:
        parts.append(word)
    if parts:
      return " and ".join(parts)
  if old[0] == new[0] == "value":
    return "value"
  if old[0] == new[0] == "function":
    return "function"
  return "kind"


_OPTIMIZER = re.compile(r"(optimizer \d+) (\(\w+\) state entries|group \d+ )")


def _pending_change(key, before, entry):
  where = "the step's " + key[len("pending work in the ") :]
  if before[1] is not None and entry[1] is not None and "unsynced" not in (before[1], entry[1]):
    return f"{where} hold other work traced and not executed yet than when the previous step began"
  return f"{where}: {_show(before)} when the previous step began, {_show(entry)} now"


def explain(old, new):
  """`differences` between two steps' signatures and states, leaving out the
  train/eval modes when `fn` sets them itself (it does not trace with the modes
  found when the step began)."""
  if old.get(_SETS_MODES) and new.get(_SETS_MODES):
    old, new = (
      {k: v for k, v in sig.items() if not k.endswith(") training")} for sig in (old, new)
    )
  return differences(old, new)


def differences(old, new, limit=3):
  """One line naming what differs between two signatures (at most `limit` places),
  or None when they are equal."""
  if old == new:
    return None
  items = []
  unseen = {}  # optimizers the old signature does not know: label -> state entries
  known = {m.group(1) for m in map(_OPTIMIZER.match, old) if m}
  for key, entry in new.items():
    before = old.get(key, _MISSING)
    if before is _MISSING:
      m = _OPTIMIZER.match(key)
      if m and m.group(1) not in known:
        if m.group(2).endswith("state entries"):
          unseen[f"{m.group(1)} {m.group(2)[: -len(' state entries')]}"] = entry[1]
        continue
      items.append(f"{key} is new ({_show(entry)})")
    elif before != entry:
      if key == "fn":
        items.append(f"a different fn ({_show(before)} -> {_show(entry)})")
      elif entry[0] == "pending":
        items.append(_pending_change(key, before, entry))
      else:
        what = _what_changed(before, entry)
        shown = [_show(e, "sharding" in what) for e in (before, entry)]
        items.append(f"{key} changed {what}: {shown[0]} -> {shown[1]}")
  # xladist knows an optimizer from its first step() inside strategy.run (or by
  # a name fn reads): its settings before that are unknown, not new.
  items[:0] = [
    f"{label} is new to xladist since the previous step began (it knows an optimizer "
    "from a name fn reads or from its first step() inside strategy.run); it has state "
    f"for {entries} parameters"
    for label, entries in unseen.items()
  ]
  for key, entry in old.items():
    if key not in new:
      items.append(f"{key} is gone (was {_show(entry)})")
  more = len(items) - limit
  line = "; ".join(items[:limit])
  if more > 0:
    line += f"; and {more} more"
  return line
