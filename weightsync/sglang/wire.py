"""SGLang's name for :mod:`weightsync.runtime.wire` (the signed call messages, shared with vLLM since they moved
there): everything, private helpers the tests use included, re-exported unchanged."""

from weightsync.runtime.wire import *  # noqa: F401,F403
from weightsync.runtime.wire import KEY_BYTES, KEY_FILE, _mac, _name_of, _private_dir  # noqa: F401
from weightsync.runtime.wire import __all__  # noqa: F401
