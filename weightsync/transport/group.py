"""The training + inference process group, built beside (never instead of) the trainer's default group.

Training processes already own ``torch.distributed``'s default group, and inference engines own
theirs; the weight-sync group spans both jobs, so it must be created without touching either. We
build it from c10d's public pieces directly:

    TCPStore (rank 0 serves) -> PrefixStore(unique prefix) -> ProcessGroupGloo / ProcessGroupNCCL

wrapped in a bare ``ProcessGroup`` whose ``send``/``recv`` return ``Work`` objects with ``wait(timeout)``.

Why not the alternatives:

- ``torch.distributed.distributed_c10d._new_process_group_helper`` is a private helper whose
  signature changes between releases; it registers the group in the module's global ``_world``
  tables (which assume ranks of the *default* group) and, for subgroups, asserts membership in the
  default group -- exactly the coupling we must avoid when the default group is the trainer's.
- vLLM's ``StatelessProcessGroup`` moves data through the TCPStore (slow, fine for metadata only),
  and its ``stateless_init_torch_distributed_process_group`` does what this module does but would
  make the training side import vLLM. Owning these ~40 lines keeps both sides dependency-free and
  puts every torch-version-specific call in one file.

The only private calls are ``ProcessGroup._set_default_backend`` / ``_register_backend`` and the
backends' ``_Options`` fields (stable since torch 2.0; vLLM relies on the same ones).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, TCPStore

from weightsync.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


# (deadline, socket) of the ports free_port handed out lately, held bound until their listener has had time to bind
_HELD: list[tuple[float, socket.socket]] = []
_HELD_LOCK = threading.Lock()
HOLD_S = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on, held back for the rendezvous that will listen on it.

    Binding port 0 and closing the socket is not enough: until the store binds the port (rank 0
    starts, imports torch: seconds on a loaded machine) the kernel may hand the same port to any
    other ``bind(0)`` on the host -- another job's ``free_port`` or one of gloo's own listeners --
    and two groups then meet in one store, or rank 0 dies on ``EADDRINUSE`` while its peers talk
    to a stranger (gloo reports ``Connection closed by peer`` at connectFullMesh). So the port stays
    bound (all addresses, ``SO_REUSEADDR``, not listening) in this process for :data:`HOLD_S`
    seconds: no ``bind(0)`` or ``connect()`` on the host is given it, while a listener that asks for
    it by number with ``SO_REUSEADDR`` (TCPStore, vLLM's server) binds it at once. A listener
    without ``SO_REUSEADDR`` cannot take it while it is held."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    now = time.monotonic()
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        port = s.getsockname()[1]
    except BaseException:
        s.close()
        raise
    with _HELD_LOCK:
        for _, old in [h for h in _HELD if h[0] <= now]:
            old.close()
        _HELD[:] = [h for h in _HELD if h[0] > now] + [(now + HOLD_S, s)]
    return port


def route_address(peer: str) -> str:
    """The address of this machine's interface that routes to ``peer``: what gloo must listen on and
    advertise to reach it. Not the hostname's address: it may not resolve (a network namespace, a
    container) or resolve to loopback (Debian's ``127.0.1.1``), and peers on another host would then
    connect to themselves. A UDP ``connect`` only picks the route; no packet is sent."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:  # no route (or an unresolvable name): the hostname, as before
        return socket.gethostname()


def new_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    device: torch.device | str | None = None,
    name: str = "weightsync",
    bind_host: str | None = None,
) -> ProcessGroup:
    """Join the ``world_size``-rank group rendezvousing at ``host:port`` as ``rank``.

    Rank 0 serves the TCPStore (it must be able to listen on ``port``); the others connect to it,
    retrying until ``timeout_s``. Every member must pass the same ``name``: it prefixes all store
    keys, so several groups (or steps' regroupings) may share one store without colliding.
    ``bind_host`` is the address this rank's gloo sockets listen on (loopback when ``host`` is
    loopback, else :func:`route_address` of ``host``). ``device`` is the CUDA device for NCCL.

    Keep rank 0 alive while others use the group: it serves the store (NCCL's watchdog polls it
    and logs warnings once it is gone; transfers already set up are unaffected).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,  # the master must not block here: its peers may start later
        )
    except dist.DistNetworkError as e:
        if rank == 0 and ("EADDRINUSE" in str(e) or "already in use" in str(e)):
            raise ConfigError(
                f"group {name!r}: rank 0 cannot serve the rendezvous on port {port}: another process listens "
                "there (its peers would join that process's store); take the port from free_port(), which "
                "holds it for this rendezvous, or pick one nothing else on the host uses"
            ) from e
        raise
    prefixed = PrefixStore(f"{name}/", store)
    pg = ProcessGroup(prefixed, rank, world_size)
    if backend == "gloo":
        if bind_host is None:
            bind_host = "127.0.0.1" if host in LOOPBACK else route_address(host)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        opts._threads = 2
        impl = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, impl)
    elif backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        dev = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        opts = dist.ProcessGroupNCCL.Options()
        # NCCL's watchdog only backs the transports' own timeout up (theirs raises a TransportError and
        # aborts the group cleanly); firing first, it would kill the process instead
        opts._timeout = timedelta(seconds=3 * timeout_s + 30)
        # NCCL's kernels go first wherever SMs free up: copies queued beside them (co-located same-GPU
        # copies, thousands of CTAs) would otherwise hold every SM and delay the link's traffic
        opts.is_high_priority_stream = True
        impl = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        pg._set_default_backend(ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, impl)
        pg.bound_device_id = dev
    else:
        raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
    return pg
