"""The prefetch thread: builds the next elements while the current step runs.

One daemon thread per iterator runs the element generator (which reads the
dataset, splits, pads and transfers the shards to the devices) and puts what it
makes into a bounded queue. The consumer takes from the queue in `next()`.

* An exception raised in the thread (in the dataset or while building an
  element) is put in the queue in place of that element and re-raised by the
  `next()` that would have returned it, with its original traceback.
* The thread never blocks for long: puts use a timeout and look at a stop
  event between tries. `close()` sets the event and joins the thread; a
  `weakref.finalize` does the same when the iterator is garbage-collected (the
  thread holds no reference to its iterator).
* The consumer's waits use timeouts too, so Ctrl-C interrupts them.
"""

import itertools
import queue
import threading
import weakref

THREAD_NAME = "xladist-prefetch"
_POLL_S = 0.05
_JOIN_TIMEOUT_S = 10.0
_counter = itertools.count()

_ITEM, _END, _ERROR = "item", "end", "error"


def _put(q, stop, entry):
  """Puts `entry`, waiting in short steps; False if the stop event came first."""
  while not stop.is_set():
    try:
      q.put(entry, timeout=_POLL_S)
      return True
    except queue.Full:
      continue
  return False


def _work(first, elements, q, stop):
  try:
    if not _put(q, stop, first):
      return
    if elements is not None:
      for element in elements:
        if not _put(q, stop, (_ITEM, element)):
          return
      _put(q, stop, (_END, None))
  except BaseException as e:  # forwarded to the consumer, who re-raises it
    _put(q, stop, (_ERROR, e))
  finally:
    close = getattr(elements, "close", None)
    if close is not None:
      try:
        close()  # runs the generator's cleanup (and its dataset iterator's)
      except Exception:  # the thread is finishing; nothing can report it
        pass


def _first(make_elements):
  """(first queue entry, the iterator to go on with) made in the caller's thread."""
  try:
    elements = make_elements()
    return (_ITEM, next(elements)), elements
  except StopIteration:
    return (_END, None), None
  except Exception as e:  # forwarded to the consumer's first get()
    return (_ERROR, e), None


def _shutdown(q, stop, thread):
  """Stops and joins the thread (also the finalizer: it must not refer to the owner)."""
  stop.set()
  while True:  # free the queue so that the thread's next put returns at once
    try:
      q.get_nowait()
    except queue.Empty:
      break
  if thread is not threading.current_thread():
    thread.join(_JOIN_TIMEOUT_S)


class Prefetcher:
  """Iterates `make_elements()` (a function returning an iterator) in a thread.

  `make_elements` is called, and its first element made, in the caller's
  thread, so that the random draws an epoch starts with (a DataLoader's
  `iter()` takes a seed from its generator, its RandomSampler draws the
  permutation when the first batch is read; on a restore, the skipped batches)
  happen at a reproducible point of the program, never at a time that depends
  on thread scheduling: a checkpoint's restore sets the global generators
  right after. An exception raised there is re-raised by the first `get()`,
  like one raised while iterating.

  Args:
    owner: the object whose garbage collection stops the thread.
    make_elements: returns an iterator of elements; iterated in the thread.
    depth: how many elements may wait in the queue (>= 1).
  """

  def __init__(self, owner, make_elements, depth):
    first, elements = _first(make_elements)
    self._queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(
      target=_work,
      args=(first, elements, self._queue, self._stop),
      name=f"{THREAD_NAME}-{next(_counter)}",
      daemon=True,
    )
    self._done = False
    self._finalizer = weakref.finalize(owner, _shutdown, self._queue, self._stop, self._thread)
    self._thread.start()

  @property
  def thread(self):
    return self._thread

  def get(self):
    """The next element; raises StopIteration at the end, or the thread's error."""
    if self._done:
      raise StopIteration
    while True:
      try:
        kind, payload = self._queue.get(timeout=_POLL_S)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          self.close()
          raise RuntimeError(
            "DistributedIterator: the prefetch thread stopped without "
            "producing an element; the iterator was closed."
          ) from None
    if kind == _ITEM:
      return payload
    self.close()
    if kind == _END:
      raise StopIteration
    raise payload.with_traceback(payload.__traceback__)

  def close(self):
    """Stops the thread and waits for it to finish. Idempotent."""
    self._done = True
    self._finalizer()  # runs _shutdown once; later calls do nothing
