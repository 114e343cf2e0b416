"""What lies between the codecs and the transports, below both: the codec interface (:mod:`.codec`) and a
bucket's bytes on the wire (:mod:`.pack`)."""
