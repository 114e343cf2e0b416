"""What a soak runs: :class:`SoakConfig` (the ``weightsync soak`` options), its checks, and the weights of each step.

A step's weights are a function of the seed and the step alone (:func:`step_weights`), so any process -- a
trainer restarted from the last step, a reader checking what it holds -- knows them without asking anyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError

#: who a fault hits: a training rank, an inference instance's control process (its WeightReader), one of
#: an instance's worker processes, the MetaServer, the file transport's directory
TARGETS = ("trainer", "reader", "worker", "meta", "files")
#: what a fault does: SIGKILL (the target is restarted as a user would), SIGSTOP for a while then SIGCONT;
#: storm: bad requests at the MetaServer (no token, another job's token, an oversized body, not HTTP, headers
#: that never end, a config bomb); squat: the directory becomes another user's while a reader restarts into it;
#: plant: another user's weight files at the names the readers wait for; slow: a training step longer than
#: ``timeout_s`` (:mod:`weightsync.soak.plays`)
ACTIONS = ("kill", "stop", "storm", "squat", "plant", "slow")
#: the kinds of fault there are, as (target, action): every process killed or stopped, and the rest where they fit
KINDS = frozenset([(t, a) for t in ("trainer", "reader", "worker", "meta") for a in ("kill", "stop")]
                  + [("meta", "storm"), ("files", "squat"), ("files", "plant"), ("trainer", "slow")])
#: kinds weightsync must take without any participant noticing: the job goes on as if nothing happened
QUIET = frozenset([("meta", "storm"), ("trainer", "slow")])


@dataclass(frozen=True)
class SoakConfig:
    """One soak (pickled into every process)."""

    seconds: float = 60.0  # how long faults are injected (from when the job is up); then the figures are printed
    faults: int = 0  # stop after this many faults, if sooner (0: no limit)
    seed: int = 0  # the faults' order and timing, and every step's weights
    model: str = "tiny-qwen3"
    train: str = "fsdp:dp=2"  # a training layout the local trainers build (hf, fsdp:dp=N)
    infer: str = "vllm:tp=2"  # the layout-faithful instances' layout
    readers: int = 2
    transport: str = "file"  # an elastic transport: readers rejoin under their id (file: sync; nixl: sync, async)
    mode: str = "sync"  # sync: update(step) every step; async: pull() the latest
    timeout_s: float = 20.0  # every participant's timeout
    instance_timeout_s: float = 5.0  # a sync step drops an instance that did not hold it within this
    fault_gap_s: float = 4.0  # mean quiet time between one fault's recovery and the next fault
    targets: tuple[str, ...] = TARGETS
    actions: tuple[str, ...] = ACTIONS
    #: random: each fault's kind drawn at random; cycle: every action on every target in turn (kill trainer,
    #: kill reader, kill worker, kill meta, stop trainer, ...: ``actions`` in their order, each on ``targets``
    #: where the kind exists), so a short soak hits every kind
    order: str = "random"
    stop_s: tuple[float, float] = (1.0, 6.0)  # how long a SIGSTOP lasts (uniform)
    storm_s: float = 4.0  # a storm's requests go on at least this long (and until every reader held a new step)
    #: a slow step's training, beyond ``timeout_s`` (the step takes ``timeout_s`` + this)
    slow_over_s: float = 3.0
    restart_after_s: float = 0.5  # a supervisor's delay before restarting a killed participant
    recover_s: float = 90.0  # a fault the job has not recovered from within this is recorded as not recovered
    step_pause_s: float = 0.2  # the trainers' pause between steps (their "training")
    staged: str = "odd"  # which readers are staged: none, all, odd (instance ids 1, 3, ...)
    workdir: str | None = None  # logs, the MetaServer's store, the file transport's files (default: a temp dir)

    def is_staged(self, instance: int) -> bool:
        return self.staged == "all" or (self.staged == "odd" and instance % 2 == 1)

    def kinds(self) -> list[tuple[str, str]]:
        """The (target, action) kinds this soak injects, in ``cycle`` order: ``actions`` in turn, each on every one
        of ``targets`` it applies to (the directory's kinds: on the file transport only)."""
        return [(t, a) for a in self.actions for t in self.targets
                if (t, a) in KINDS and (t != "files" or self.transport == "file")]


def check(cfg: SoakConfig) -> None:
    """Refuse what cannot run, before any process starts."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec
    from weightsync.transport.base import TRANSPORTS, elastic_transports

    entry = TRANSPORTS.get(cfg.transport)
    if entry is None or not entry.elastic:
        raise ConfigError(f"soak: --transport must be elastic ({', '.join(elastic_transports())}): a restarted "
                          f"reader rejoins the running job; not {cfg.transport!r}")
    if cfg.mode not in entry.modes:
        raise ConfigError(f"soak: {cfg.transport} runs {' and '.join(sorted(entry.modes))}, not --mode {cfg.mode}")
    if cfg.seconds <= 0 or cfg.readers < 1 or cfg.faults < 0:
        raise ConfigError("soak: --seconds must be positive, --readers at least 1 and --faults at least 0")
    bad = [t for t in cfg.targets if t not in TARGETS] + [a for a in cfg.actions if a not in ACTIONS]
    if bad or not cfg.targets or not cfg.actions:
        raise ConfigError(f"soak: targets are {', '.join(TARGETS)} and actions {', '.join(ACTIONS)}; got {bad or 'none'}")
    if not cfg.kinds():
        raise ConfigError(f"soak: no kind of fault is both in --targets {','.join(cfg.targets)} and --actions "
                          f"{','.join(cfg.actions)} (kinds: {', '.join(sorted(f'{a} {t}' for t, a in KINDS))}; "
                          "the files target needs --transport file)")
    if cfg.storm_s <= 0 or cfg.slow_over_s <= 0:
        raise ConfigError("soak: --storm-s and --slow-over-s must be positive")
    if cfg.order not in ("random", "cycle"):
        raise ConfigError(f"soak: --order must be random or cycle, not {cfg.order!r}")
    if cfg.staged not in ("none", "all", "odd"):
        raise ConfigError(f"soak: --staged must be none, all or odd, not {cfg.staged!r}")
    if not 0 < cfg.stop_s[0] <= cfg.stop_s[1]:
        raise ConfigError(f"soak: --stop-s must be 0 < MIN <= MAX, got {cfg.stop_s}")
    spec = load_spec(cfg.model)
    train = make_layout(spec, cfg.train)
    if train.engine not in ("hf", "fsdp"):
        raise ConfigError(f"soak: --train {cfg.train!r}: the soak's trainers are hf or fsdp:dp=N")
    make_layout(spec, cfg.infer)  # a bad layout is refused here


def step_weights(cfg: SoakConfig, spec, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s canonical weights (random, never zeros; the same in every process)."""
    from weightsync.testing import random_canonical

    return random_canonical(spec, seed=cfg.seed * 1_000_003 + step)


__all__ = ["ACTIONS", "KINDS", "QUIET", "TARGETS", "SoakConfig", "check", "step_weights"]
