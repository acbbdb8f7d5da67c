"""The process a run lives in: clean stops on SIGINT/SIGTERM, deterministic algorithms.

Modules: ``stop`` (the first signal stops a run after its step; in-process calls pass the signal
on to their caller), ``determinism`` (``--deterministic``: torch's deterministic algorithms and
cuBLAS's workspace setting). Neither imports memfine; :mod:`memfine.train` and
:mod:`memfine.cli` use them.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
