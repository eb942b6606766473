"""Where a task of a parameter-server cluster listens: its address in the cluster spec.

A task listens on three kinds of sockets, all opened by torch 2.9:

* the rendezvous store (a TCPStore) on the chief, at the chief's address and
  port from the cluster spec. torch's `tcp://` rendezvous binds it to every
  interface ("::"); the `xladist://` rendezvous here binds it to the spec's
  address only (a socket bound here, handed to TCPStore as
  `master_listen_fd`);
* TensorPipe's listeners (the RPC agent and its multiplexed channel), on
  ports of its choosing;
* gloo's, for the barrier of the static RPC group, on ports of its choosing.

TensorPipe and gloo bind to the address the machine's hostname resolves to,
or to the first address of the interface named by `TP_SOCKET_IFNAME` /
`GLOO_SOCKET_IFNAME`; `listen_on` sets both to the interface that holds the
task's address from the cluster spec (unless the user set them), for the
time the task joins. An address that is on no interface of this host (a NAT
or a service address) leaves torch's defaults, with a warning.

The ports are TensorPipe's and gloo's: only the chief's port in the spec is
used (as the rendezvous).
"""

import contextlib
import datetime
import errno
import fcntl
import os
import socket
import struct
import warnings
from urllib.parse import urlparse

SCHEME = "xladist"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_registered = {"done": False}


def split_address(address):
  """ "host:port" or "[v6]:port" -> (host, port)."""
  parsed = urlparse(f"//{address}")
  return parsed.hostname, parsed.port


def resolve(host):
  """The IP address `host` resolves to (the first one), or None."""
  try:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
  except OSError:
    return None


def interface_addresses():
  """{interface name: its IPv4 address} of this host's interfaces that have one."""
  out = {}
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in socket.if_nameindex():
      try:
        raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
      except OSError:
        continue  # no IPv4 address
      out[name] = socket.inet_ntoa(raw[20:24])
  return out


def interface_of(ip):
  """The name of this host's network interface whose (IPv4) address is `ip`, or None."""
  if ip is None or ":" in ip:
    return None
  return next((name for name, a in interface_addresses().items() if a == ip), None)


@contextlib.contextmanager
def listen_on(address, api):
  """Makes TensorPipe and gloo listen on the interface of `address` ("host:port",
  this task's address in the cluster spec) while the task joins."""
  host, _ = split_address(address)
  ip = resolve(host)
  name = interface_of(ip)
  wanted = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
  if name is None:
    if not all(os.environ.get(k) for k in wanted):
      warnings.warn(
        f"{api}: this task's address {address} in the cluster spec ({ip or 'unresolved'}) "
        "is not an IPv4 address of an interface of this host, so torch's TensorPipe "
        "and gloo listen on the address the hostname resolves to. Set "
        "TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the interface to listen on.",
        RuntimeWarning,
        stacklevel=3,
      )
    yield
    return
  saved = {k: os.environ.get(k) for k in wanted}
  for k in wanted:
    os.environ.setdefault(k, name)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def register_rendezvous():
  """Registers the `xladist://host:port` rendezvous with torch.distributed (once)."""
  import torch.distributed as dist

  if not _registered["done"]:
    dist.register_rendezvous_handler(SCHEME, _rendezvous)
    _registered["done"] = True


def client_store(address, timeout):
  """A client of the chief's rendezvous store at `address` ("host:port"); it
  waits up to `timeout` seconds for the chief to be up."""
  from torch.distributed import TCPStore

  host, port = split_address(address)
  return TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))


def _rendezvous(url, timeout=datetime.timedelta(minutes=30), **kwargs):
  """torch's tcp:// rendezvous, with the chief's store bound to its own address."""
  from torch.distributed import TCPStore

  parsed = urlparse(url)
  query = dict(p.split("=", 1) for p in parsed.query.split("&") if "=" in p)
  rank, world_size = int(query["rank"]), int(query["world_size"])
  host, port = parsed.hostname, parsed.port
  fd = _bound_socket(host, port) if rank == 0 else None
  store = TCPStore(
    host,
    port,
    world_size,
    rank == 0,
    timeout,
    multi_tenant=fd is None,
    master_listen_fd=fd,
  )
  yield store, rank, world_size
  raise RuntimeError("xladist:// rendezvous: a cluster forms once")


def _bound_socket(host, port):
  """A listening socket at the chief's address from the cluster spec (its fd,
  which TCPStore then owns), or None (the store binds every interface) when
  the address is not one of this host's."""
  ip = resolve(host)
  if ip is None:
    return None
  family = socket.AF_INET6 if ":" in ip else socket.AF_INET
  s = socket.socket(family, socket.SOCK_STREAM)
  try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, port))
    s.listen(socket.SOMAXCONN)
  except OSError as e:
    s.close()
    if e.errno != errno.EADDRNOTAVAIL:
      raise
    warnings.warn(
      f"xladist: the chief's address {host}:{port} in the cluster spec is not an "
      "address of this host, so its rendezvous store listens on every interface.",
      RuntimeWarning,
      stacklevel=2,
    )
    return None
  return s.detach()
