"""``python -m histoinfer``: the same as the ``histoinfer`` command."""

from .cli import main

# Guarded: the bench's child processes start with `spawn`, which imports the main module again.
if __name__ == "__main__":
    raise SystemExit(main())
