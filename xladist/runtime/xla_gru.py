"""torch's own GRU where torch_xla 2.9 puts its scan-based one.

Importing torch_xla 2.9 replaces `torch.nn.GRU` with a scan-based subclass
(`torch_xla.experimental.gru.GRU`). The torch_xla runtime gives the class back
to torch when it starts (`restore_torch_gru`) and runs torch's forward for a GRU
made before that while a step is traced (`torch_gru`).
"""

import contextlib


def restore_torch_gru():
  """Gives `torch.nn.GRU` back to torch.

  The scan GRU's forward runs torch_xla's scan whatever the device: a GRU made
  after the first strategy and run on the CPU (a reference model, an evaluation
  on the host) failed ("Expected all tensors in the given list to be XLA
  tensors"). A GRU made before, while torch_xla's class was in place, still
  works inside steps (`torch_gru`).
  """
  import torch

  original = getattr(torch.nn.GRU, "_orig", None)
  if original is not None:
    torch.nn.GRU = original


@contextlib.contextmanager
def torch_gru():
  """torch's own GRU forward while a step is traced.

  The scan GRU traces the cell ahead of time with fake tensors and AOT
  autograd, which reads values on the host inside a step's manual region;
  torch's forward computes the same values (the time loop unrolled into the
  step's program).
  """
  from torch.nn.modules import rnn
  from torch_xla.experimental import gru

  scan_forward = gru.GRU.__dict__.get("forward")
  gru.GRU.forward = rnn.GRU.forward
  try:
    yield
  finally:
    if scan_forward is None:
      del gru.GRU.forward
    else:
      gru.GRU.forward = scan_forward
