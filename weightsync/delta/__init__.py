"""Delta updates: the algorithms behind the delta codec (:mod:`weightsync.codec.delta`).

:mod:`.codec` encodes and decodes one bucket's words (indices, bitmap, blocks, full, same) and checksums
them; :mod:`.state` keeps the sender's previous version; :mod:`.walk` replays an RL trainer's steps and
:mod:`.measure` measures real ones; :mod:`.bench` times them. Which transports carry deltas is what
they serve the codec (:func:`weightsync.codec.registry.check`); docs/delta.md says why and what it costs.
"""
