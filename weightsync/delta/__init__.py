"""Delta updates: send each bucket as what changed since the version its receiver proves it holds.

:mod:`.codec` encodes and decodes one bucket; :mod:`.state` keeps the sender's previous version and
the receivers' proofs; :mod:`.p2p` and :mod:`.file` run them over the transports; docs/delta.md says
why and what it costs.
"""
