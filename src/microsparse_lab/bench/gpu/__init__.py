"""The parts of ``python -m microsparse_lab.bench.gpu_check``: checks, steps, selection, report."""
