"""Delta updates: send each bucket as what changed since the version its receiver proves it holds.

:mod:`.codec` encodes and decodes one bucket; :mod:`.state` keeps the sender's previous version and
the receivers' proofs; :mod:`.p2p`, :mod:`.file` and :mod:`.nixl` run them over the transports; docs/delta.md says
why and what it costs.
"""

from weightsync.errors import ConfigError

#: the transports whose async pulls run deltas: a pull that proves the base of the staged snapshot's
#: delta reads only the change (file has no async mode; p2p's pull server sends the snapshot whole)
ASYNC = frozenset({"nixl"})


def check_options(transport: str, mode: str, delta: bool) -> None:
    """Refuse ``delta=True`` where it does not run, before any I/O, saying what to do.

    Co-located copies gain nothing (the bytes never cross a link: the workers copy GPU memory), so
    delta=True is refused there rather than silently ignored. A transport runs deltas once its
    registry entry says ``delta=True`` (p2p, file and nixl: :mod:`.p2p`, :mod:`.file`, :mod:`.nixl`).
    Async mode runs deltas where the pull path proves its base against the staged snapshot
    (:data:`ASYNC`: nixl, :mod:`.nixl`); elsewhere an async pull takes the whole snapshot, so it is refused."""
    if not delta:
        return
    from weightsync.transport.base import TRANSPORTS

    if transport == "colocated":
        raise ConfigError("delta=True gains nothing co-located (the workers copy GPU memory, no link is crossed); "
                          "drop delta=True or use a separated transport (p2p, file, nixl)")
    entry = TRANSPORTS[transport]
    if not entry.delta:
        runs = ", ".join(n for n, e in TRANSPORTS.items() if e.delta)
        raise ConfigError(f"delta=True runs over the {runs} transport(s), not {transport} (yet); drop delta=True")
    if mode != "sync" and transport not in ASYNC:
        raise ConfigError(f"delta=True runs in sync mode over {transport} (its async pull takes the whole snapshot), "
                          f"not {mode}; use mode='sync', transport {' or '.join(sorted(ASYNC))} in async mode, "
                          "or drop delta=True")
