"""Local jobs: every participant of a weight-sync job as a process on this machine.

:mod:`weightsync.local.runner` starts and watches them (typed events from
:mod:`weightsync.local.events`); :mod:`weightsync.local.trainers` builds real training engines
(transformers, FSDP2, megatron-core) in them; :mod:`weightsync.local.instances` builds the
inference instances. Used by ``weightsync demo``, ``weightsync bench`` and the end-to-end tests.
"""
