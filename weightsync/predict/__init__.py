"""What a plan will cost: the link simulator (:mod:`.simulate`) and the plan statistics built on it (:mod:`.stats`),
above the planner, the codecs' size rules and the transports they model."""
