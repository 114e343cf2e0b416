"""Import stub for vLLM 0.26 on the GPU host: the real xgrammar 0.2.9 (in the MOE=1 kit) needs apache-tvm-ffi>=0.1.11,
a 3.3 MB wheel with no room beside the kit in one 64 MiB carry. vLLM evaluates ``xgr.GrammarMatcher`` /
``xgr.CompiledGrammar`` as dataclass annotations at ``from vllm import LLM``; guided decoding is never used by the
benchmarks, so every name here is a class that raises when called. Put this folder BEFORE the kit on PYTHONPATH."""

__version__ = "0.0.0-stub"


class _Stub:
    def __init__(self, *a, **k):
        raise RuntimeError("xgrammar is a stub in this kit: guided decoding is unavailable")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    cls = type(name, (_Stub,), {})
    globals()[name] = cls
    return cls
