"""``python -m qkv`` runs the ``qkv`` command."""

from .cli import main

raise SystemExit(main())
