"""``weightsync soak``: a chaos soak of a whole local job, owned by the project.

A real MetaServer (its own process, persisting), training ranks and layout-faithful inference instances, each
a process of the local runner (:mod:`weightsync.local.runner`); every kind of participant -- training rank,
reader, an instance's worker, the MetaServer -- SIGKILLed or SIGSTOPped at random and restarted as a user
would; the invariant "no reader reports a version it does not hold bit for bit" checked after every update
and every failed one; the figures (faults by kind, steps, holds, recoveries, time to detect and to recover)
printed at the end. :mod:`.config` is what runs, :mod:`.participants` the processes, :mod:`.driver` the
faults and the figures, :mod:`.cli` the command.
"""
