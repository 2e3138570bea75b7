"""What to install for an optional part of histoinfer, said alike wherever it is missing."""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, for an installed package and for a clone (a
    wheel's user was told only ``pip install -e '.[server]'``, which needs a clone)."""
    return f"pip install 'histoinfer[{extra}]' (in a clone: pip install -e '.[{extra}]')"
