"""The codec stage between the plan and the transports (:mod:`.base`): ``full`` (:mod:`.full`), ``delta``
(:mod:`.delta`); :mod:`.registry` names them and checks a transport serves what a codec needs."""
