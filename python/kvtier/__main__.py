"""``python -m kvtier`` runs the command-line interface."""

from kvtier.cli import main

raise SystemExit(main())
