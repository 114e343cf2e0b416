"""Import stub for vLLM 0.26 on the GPU host (the MOE=1 kit has no room for the 3 MB llguidance wheel in one 64 MiB
carry). vLLM evaluates ``llguidance.LLMatcher`` / ``LLTokenizer`` as dataclass annotations in
``v1/structured_output/backend_guidance.py`` at ``from vllm import LLM``; guided decoding is never used by the
benchmarks, so any use of this stub raises."""

__version__ = "0.0.0-stub"


class _Stub:
    def __init__(self, *a, **k):
        raise RuntimeError("llguidance is a stub in this kit: guided decoding is unavailable")


class LLMatcher(_Stub):
    pass


class LLTokenizer(_Stub):
    pass


class LLInterpreter(_Stub):
    pass


class StructTag(_Stub):
    pass
