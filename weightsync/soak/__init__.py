"""``weightsync soak``: a chaos soak of a whole local job, owned by the project.

A real MetaServer (its own process, persisting), training ranks and layout-faithful inference instances, each
a process of the local runner (:mod:`weightsync.local.runner`); every kind of participant -- training rank,
reader, an instance's worker, the MetaServer -- SIGKILLed or SIGSTOPped at random and restarted as a user
would; bad requests stormed at the MetaServer, the file transport's directory squatted or planted with another
user's files, a training step longer than every timeout, each checked as designed; the invariant "no reader
reports a version it does not hold bit for bit" checked after every update and every failed one; the figures
(faults by kind, steps, holds, recoveries, time to detect and to recover) printed at the end. :mod:`.config` is
what runs, :mod:`.participants` the processes, :mod:`.driver` the faults and the figures, :mod:`.plays` the faults
that run a while (:mod:`.storm` the bad requests), :mod:`.cli` the command.
"""
