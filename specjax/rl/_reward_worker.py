"""A reward worker process (`specjax.rl.reward_workers`, kind "process"), run by path.

It imports nothing of specjax (nor JAX): a worker starts in well under a second and holds only
what the reward functions it is sent import. Messages are pickled tuples over two pipes whose
descriptors are its arguments:

  ("path", [sys.path entries])            the parent's import path, first
  ("function", key, blob)                 a reward function, pickled by cloudpickle
  ("call", task, key, {argument: value})  call function `key` -> ("started", task) once it is
                                          unpickled, then ("ok", task, values) or
                                          ("error", task, type name, message, traceback)

It exits when the parent closes its end (or dies), or when the parent kills it (a timeout).
"""

import pickle
import sys
import traceback
from multiprocessing.connection import Connection


def _serve(inbox: Connection, outbox: Connection) -> None:
  functions = {}
  while True:
    try:
      message = pickle.loads(inbox.recv_bytes())
    except (EOFError, OSError):
      return
    kind = message[0]
    if kind == "path":
      sys.path[:] = [p for p in message[1] if p not in sys.path] + sys.path
      continue
    if kind == "function":
      _, key, blob = message
      functions[key] = blob  # unpickled at its first call, so that a failure names the call
      continue
    _, task, key, arguments = message
    try:
      fn = functions[key]
      if isinstance(fn, bytes):
        fn = functions[key] = pickle.loads(fn)
      outbox.send_bytes(pickle.dumps(("started", task)))  # its timeout runs from here
      values = fn(**arguments)
      if not isinstance(values, (list, tuple)):
        values = list(values)
      reply = pickle.dumps(("ok", task, list(values)))
    except BaseException as err:  # noqa: BLE001 (every failure goes back to the parent)
      reply = pickle.dumps(("error", task, type(err).__name__, str(err),
                            traceback.format_exc(limit=8)))
    outbox.send_bytes(reply)


if __name__ == "__main__":
  _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]),
                                                                  readable=False))
