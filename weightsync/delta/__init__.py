"""Delta updates: send each bucket as what changed since the version its receiver proves it holds.

:mod:`.codec` encodes and decodes one bucket; :mod:`.state` keeps the sender's previous version and
the receivers' proofs; :mod:`.p2p` and :mod:`.file` run them over the transports; docs/delta.md says
why and what it costs.
"""

from weightsync.errors import ConfigError


def check_options(transport: str, mode: str, delta: bool) -> None:
    """Refuse ``delta=True`` where it does not run, before any I/O, saying what to do.

    Co-located copies gain nothing (the bytes never cross a link: the workers copy GPU memory), so
    delta=True is refused there rather than silently ignored. A transport runs deltas once its
    registry entry says ``delta=True`` (p2p and file today; NIXL's hook: encode with
    :func:`weightsync.delta.codec.encode` against a :class:`weightsync.delta.state.PreviousVersion`
    and register the payload, as :mod:`weightsync.delta.p2p` does). Async pulls take the whole
    snapshot: sync mode only."""
    if not delta:
        return
    from weightsync.transport.base import TRANSPORTS

    if transport == "colocated":
        raise ConfigError("delta=True gains nothing co-located (the workers copy GPU memory, no link is crossed); "
                          "drop delta=True or use a separated transport (p2p, file)")
    entry = TRANSPORTS[transport]
    if not entry.delta:
        runs = ", ".join(n for n, e in TRANSPORTS.items() if e.delta)
        raise ConfigError(f"delta=True runs over the {runs} transport(s), not {transport} (yet); drop delta=True")
    if mode != "sync":
        raise ConfigError(f"delta=True runs in sync mode (an async pull takes the whole snapshot), not {mode}; "
                          "use mode='sync' or drop delta=True")
