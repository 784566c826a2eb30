"""``python -m microsparse_lab``: the same as the ``microsparse`` command (e.g. under torchrun)."""

from microsparse_lab.cli import entry

if __name__ == "__main__":  # spawned workers import this module too; they must not re-run main
    entry()
