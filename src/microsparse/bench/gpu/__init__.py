"""The parts of ``python -m microsparse.bench.gpu_check``: checks, steps, selection, report."""
