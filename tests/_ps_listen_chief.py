"""The chief of a small cluster that reports where its tasks listen.

`python _ps_listen_chief.py HOST`: starts 1 worker and 1 ps task
(`_ps_server.py`) with every address of the cluster spec on HOST, joins as
the chief, runs one function, and prints one JSON line {task: [[ip, port],
...]} of the TCP sockets each process listens on (read from /proc: a socket
listed in /proc/PID/net/tcp* in state LISTEN whose inode is one of the
process's file descriptors), plus "spec"; then ends the cluster.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import _ps_fns as fns

import xladist as xd

HERE = pathlib.Path(__file__).parent
_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _free_port(host):
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _ip(hex_address, v6):
  raw = bytes.fromhex(hex_address)
  if v6:  # four 32-bit words, each in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, raw)
  return socket.inet_ntop(socket.AF_INET, raw[::-1])


def listening(pid):
  """[(ip, port)] of the TCP sockets process `pid` listens on."""
  inodes = set()
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:[") : -1])
  out = []
  for table, v6 in (("tcp", False), ("tcp6", True)):
    try:
      with open(f"/proc/{pid}/net/{table}") as f:
        rows = f.read().splitlines()[1:]
    except FileNotFoundError:
      continue
    for row in rows:
      fields = row.split()
      if fields[3] == _LISTEN and fields[9] in inodes:
        address, port = fields[1].split(":")
        out.append((_ip(address, v6), int(port, 16)))
  return sorted(out)


def main():
  host = sys.argv[1]
  spec = {
    "chief": [f"{host}:{_free_port(host)}"],
    "worker": [f"{host}:{_free_port(host)}"],
    "ps": [f"{host}:{_free_port(host)}"],
  }
  env = dict(os.environ, CPU_NUM_DEVICES="1", OMP_NUM_THREADS="1")
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
  procs = {}
  for job in ("worker", "ps"):
    cmd = [sys.executable, str(HERE / "_ps_server.py"), json.dumps(spec), job, "0"]
    procs[f"{job}:0"] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
  try:
    resolver = xd.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0)
    strategy = xd.ParameterServerStrategy(resolver)
    coordinator = xd.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
      v = xd.Variable(1.0)
    coordinator.schedule(fns.read_value, args=(v,)).fetch()
    report = {"chief:0": listening(os.getpid())}
    report.update({task: listening(p.pid) for task, p in procs.items()})
    print(json.dumps({"spec": spec, "listening": report}), flush=True)
    coordinator.shutdown()
    for p in procs.values():
      p.wait(timeout=60)
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  sys.stdout.flush()
  os._exit(0)  # as _ps_server.py: torch's exit handlers are slow and nothing is left


if __name__ == "__main__":
  main()
