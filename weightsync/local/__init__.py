"""Local jobs: every participant of a weight-sync job as a process on this machine.

:mod:`weightsync.local.runner` starts and watches them (typed events from
:mod:`weightsync.local.events`); :mod:`weightsync.local.trainers` builds real training engines
(transformers, FSDP2, megatron-core) in them; :mod:`weightsync.local.instances` builds the
inference instances. Used by ``weightsync demo``, ``weightsync bench`` and the end-to-end tests.
:mod:`weightsync.local.demo_job` is the demo's job (options -> LocalJob), its processes
:mod:`weightsync.local.demo_participants`.
"""
