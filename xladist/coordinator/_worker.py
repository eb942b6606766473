"""What a worker does: runs the functions the chief schedules, on its XLA device.

A scheduled function arrives pickled (`xladist/coordinator/_wire.py`); the
objects that live elsewhere travel as references (persistent ids):

* ("v", VarInfo): a ps variable -> this worker's copy of it, an XLA tensor
  (a Parameter for trainable ones) kept between functions, so that modules
  unpickled for each function share it;
* ("s",): the strategy -> ParameterServerStrategy as a worker sees it (one
  replica on this worker's device);
* ("o", spec): an optimizer -> a `RemoteOptimizer` whose `step()` sends the
  gradients to the ps tasks, which apply them and return the new values;
* ("w", id): a per-worker value (dataset, iterator) -> this worker's own.

Running a function: read every variable it refers to from the ps tasks (one
call per ps task), run it with the strategy in scope (torch_xla traces it into
one program), send what it wrote to variables otherwise than through the
optimizer (its change, which the ps task adds: `assign_add` from several
workers adds up, as TF's remote assign_add), bring its outputs back as CPU
tensors. Functions return data, never raise (`_ps/rpc.py` error records).
"""

import inspect
import io
import pickle
import threading

import torch

from xladist import runtime as _runtime
from xladist._nest import flatten, unflatten
from xladist._ps import rpc as _rpc
from xladist._ps import task as _ps_task
from xladist.input.dataset import DistributedDataset
from xladist.input.options import InputContext
from xladist.strategies import parameter_server as ps

_lock = threading.Lock()  # one function or resource call at a time on a worker
_state = {"worker": None}


class _Worker:
  """This worker's lasting state: its variables' copies and per-worker values."""

  def __init__(self):
    task = _rpc.current_task()
    layout = _rpc.current_layout()
    self.task = task
    self.index = int(task.split(":")[1])
    self.device = _runtime.device()
    self.strategy = ps.worker_strategy(self.index, layout.num_workers, layout.num_ps)
    self.copies = {}  # var_id -> XLA tensor
    self.resources = {}  # per-worker value id -> object


def _worker():
  if _state["worker"] is None:
    _state["worker"] = _Worker()
  return _state["worker"]


class _Run:
  """One scheduled function on this worker."""

  def __init__(self, worker, timeout):
    self.worker = worker
    self.timeout = timeout
    self.used = {}  # var_id -> (VarInfo, tensor)
    self.base = {}  # var_id -> (tensor id, version, CPU value) when last read

  # -- references --------------------------------------------------------------------
  def copy_of(self, info):
    t = self.worker.copies.get(info.var_id)
    if t is None:
      value = torch.zeros(info.shape, dtype=info.dtype, device=self.worker.device)
      t = torch.nn.Parameter(value) if info.trainable else value
      self.worker.copies[info.var_id] = t
    self.used[info.var_id] = (info, t)
    return t

  def load(self, payload):
    run = self

    class Unpickler(pickle.Unpickler):
      def persistent_load(self, pid):
        kind = pid[0]
        if kind == "v":
          return run.copy_of(pid[1])
        if kind == "s":
          return run.worker.strategy
        if kind == "o":
          return RemoteOptimizer(run, pid[1])
        if kind == "w":
          try:
            return run.worker.resources[pid[1]]
          except KeyError:
            raise RuntimeError(
              f"{run.worker.task}: a per-worker value (id {pid[1]}) that this "
              "worker does not hold was passed to a scheduled function."
            ) from None
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")

    return Unpickler(io.BytesIO(payload)).load()

  # -- variables ----------------------------------------------------------------------
  def read(self):
    """Reads every variable the function refers to from the ps tasks."""
    entries = list(self.used.values())
    if not entries:
      return
    values = ps.read_variables([info for info, _ in entries], self.timeout)
    tensors = [t for _, t in entries]
    for t in tensors:
      t.grad = None  # a function starts with no gradients
    self.set_values(tensors, [info.var_id for info, _ in entries], values)

  def set_values(self, tensors, var_ids, values):
    placed = [v.to(self.worker.device) for v in values]
    with torch.no_grad():
      for t, var_id, value, cpu in zip(tensors, var_ids, placed, values):
        t.data = value
        self.base[var_id] = (_runtime.creation_index(t), t._version, cpu)

  def written(self):
    """(VarInfo, tensor, value before) of the variables the function may have
    written: those written in place or replaced since they were read (version
    counter, the runtime's creation index) and every non-trainable one (torch_xla's
    batch-norm kernel updates running statistics without touching either)."""
    out = []
    for var_id, (info, t) in self.used.items():
      created, version, before = self.base[var_id]
      if not info.trainable or _runtime.creation_index(t) != created or t._version != version:
        out.append((info, t, before))
    return out

  def send_writes(self):
    """Sends each written variable's change; the ps tasks add it."""
    writes = self.written()
    if not writes:
      return
    _runtime.sync()
    now = _runtime.to_host([t.detach() for _, t, _ in writes])
    items = []
    for (info, _, before), value in zip(writes, now):
      if torch.equal(value, before):
        continue
      delta = value - before
      for (task, _, _), key, part in zip(info.shards, info.keys(), ps.split_rows(info, delta)):
        items.append((task, (key, part.contiguous())))
    if not items:
      return
    calls = {
      task: (_ps_task.add, ([k for k, _ in e], [d for _, d in e]))
      for task, e in ps.group_by_task(items).items()
    }
    ps.call_all(calls, self.timeout, "sending variable writes")


class RemoteOptimizer:
  """A worker's stand-in for an optimizer of the chief whose variables live on
  the ps tasks: `step()` sends the gradients there; the ps tasks run the
  optimizer (its state is theirs) and this worker continues with the values
  they return. `param_groups` hold the worker's copies of the variables."""

  def __init__(self, run, spec):
    opt_id, cls, defaults, groups = spec
    self._run = run
    self._id, self._cls = opt_id, cls
    self.defaults = defaults
    self.param_groups = []
    self._infos = {}
    for hyper, infos in groups:
      params = []
      for info in infos:
        t = run.copy_of(info)
        self._infos[id(t)] = info
        params.append(t)
      self.param_groups.append(dict(hyper, params=params))
    self.state = {}

  def __repr__(self):
    return f"RemoteOptimizer({self._cls.__name__}, applied on the ps tasks)"

  def zero_grad(self, set_to_none=True):
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is None:
          continue
        if set_to_none:
          p.grad = None
        else:
          p.grad.detach_().zero_()

  def step(self, closure=None):
    """Sends this step's gradients to the ps tasks and takes the new values."""
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    params, hypers = [], []
    for group in self.param_groups:
      hyper = {k: v for k, v in group.items() if k != "params"}
      for p in group["params"]:
        if p.grad is not None:
          params.append(p)
          hypers.append(hyper)
    if not params:
      return loss
    _runtime.sync()  # one program: the step so far, gradients included
    grads = _runtime.to_host([p.grad for p in params])
    items = []
    for p, hyper, grad in zip(params, hypers, grads):
      info = self._infos[id(p)]
      for (task, _, _), key, part in zip(info.shards, info.keys(), ps.split_rows(info, grad)):
        items.append((task, (key, hyper, part.contiguous())))
    by_task = ps.group_by_task(items)
    results = ps.call_all(
      {
        task: (_ps_task.apply, (self._id, self._cls, self.defaults, entries, []))
        for task, entries in by_task.items()
      },
      self._run.timeout,
      "applying gradients",
    )
    got = {}
    for task, entries in by_task.items():
      got.update(zip([key for key, _, _ in entries], results[task]))
    infos = [self._infos[id(p)] for p in params]
    values = [ps.join_rows(info, [got[k] for k in info.keys()]) for info in infos]
    self._run.set_values(params, [info.var_id for info in infos], values)
    return loss

  def state_dict(self):
    raise RuntimeError(
      "RemoteOptimizer.state_dict on a worker: the optimizer's state lives on the "
      "ps tasks; save it on the chief (optimizer.state_dict() there reads it)."
    )


def _to_host(out):
  leaves, spec = flatten(out)
  is_dev = _runtime.is_device_tensor
  xla = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and is_dev(x)]
  if xla:
    _runtime.sync()
    host = _runtime.to_host([leaves[i].detach() for i in xla])
    for i, h in zip(xla, host):
      leaves[i] = h
  leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
  out = unflatten(spec, leaves)
  try:
    pickle.dumps(out)
  except Exception as e:  # noqa: BLE001 - reported as the function's error
    raise TypeError(
      "A scheduled function returned a value that cannot be sent back to the "
      f"chief ({e}); return tensors, numbers and nests of them."
    ) from None
  return out


def _errors(fn):
  def run(*args):
    try:
      with _lock:
        return ("ok", fn(*args))
    except _rpc.TaskUnavailableError as e:
      return _rpc.error_record(e, _rpc.current_task() or "worker:?", kind="ps")
    except BaseException as e:  # noqa: BLE001 - the user's error, returned as data
      return _rpc.error_record(e, _rpc.current_task() or "worker:?")

  return run


def _run_closure(payload, timeout):
  worker = _worker()
  run = _Run(worker, timeout)
  fn, args, kwargs = run.load(payload)
  run.read()
  with worker.strategy.scope():
    out = fn(*args, **kwargs)
  run.send_writes()
  return _to_host(out)


def _create_resource(resource_id, payload, timeout):
  worker = _worker()
  run = _Run(worker, timeout)
  fn, args, kwargs = run.load(payload)
  run.read()
  with worker.strategy.scope():
    worker.resources[resource_id] = fn(*args, **kwargs)
  return None


def _delete_resource(resource_id):
  _worker().resources.pop(resource_id, None)
  return None


run_closure = _errors(_run_closure)
run_closure.__qualname__ = run_closure.__name__ = "run_closure"
create_resource = _errors(_create_resource)
create_resource.__qualname__ = create_resource.__name__ = "create_resource"
delete_resource = _errors(_delete_resource)
delete_resource.__qualname__ = delete_resource.__name__ = "delete_resource"


# -- per-worker datasets ----------------------------------------------------------------


def make_dataset(dataset_fn):
  """A worker's dataset: `dataset_fn()` or `dataset_fn(input_context)`, a
  distributed dataset made on the chief (built here), or a dataset passed
  itself (this worker's copy of it)."""
  worker = _worker()
  strategy = worker.strategy
  if isinstance(dataset_fn, ps._DatasetSpec):
    if dataset_fn.dataset_fn is not None:
      return strategy.distribute_datasets_from_function(dataset_fn.dataset_fn, dataset_fn.options)
    return strategy.experimental_distribute_dataset(dataset_fn.dataset, dataset_fn.options)
  if not callable(dataset_fn):
    return dataset_fn
  if _takes_an_argument(dataset_fn):
    layout = _rpc.current_layout()
    return dataset_fn(InputContext(layout.num_workers, worker.index, 1))
  return dataset_fn()


def _takes_an_argument(fn):
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return False
  positional = [
    p
    for p in params
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
  ]
  return len(positional) == 1


def make_iterator(dataset):
  """An iterator over a worker's dataset; plain datasets' elements go to the
  worker's device as they are taken."""
  if isinstance(dataset, DistributedDataset):
    return iter(dataset)
  return _DeviceIterator(iter(dataset), _worker().device)


class _DeviceIterator:
  def __init__(self, iterator, device):
    self._iterator, self._device = iterator, device

  def __iter__(self):
    return self

  def __next__(self):
    leaves, spec = flatten(next(self._iterator))
    return unflatten(
      spec, [x.to(self._device) if isinstance(x, torch.Tensor) else x for x in leaves]
    )
