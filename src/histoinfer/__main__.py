"""``python -m histoinfer``: the same as the ``histoinfer`` command."""

from .cli import main

raise SystemExit(main())
