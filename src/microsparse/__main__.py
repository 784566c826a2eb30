"""``python -m microsparse``: the same as the ``microsparse`` command."""

from microsparse.cli import entry

if __name__ == "__main__":  # spawned workers import this module too; they must not re-run main
    entry()
