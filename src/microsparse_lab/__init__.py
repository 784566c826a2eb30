"""The harness around the :mod:`microsparse` library: the ``microsparse`` command, the paper's
training tasks, the benchmarks, the simulator, the network test bed and the reports.

It imports the library and is never imported by it (``tests/test_layers.py`` checks the
rule). Its own dependencies come with the ``lab`` extra: ``pip install 'microsparse[lab]'``.
"""

from importlib.util import find_spec

_MISSING = [name for name in ("numpy", "tqdm") if find_spec(name) is None]
if _MISSING:
    raise ImportError(
        f"microsparse_lab (the microsparse command, tasks and benchmarks) needs "
        f"{' and '.join(_MISSING)}: pip install 'microsparse[lab]'"
    )
