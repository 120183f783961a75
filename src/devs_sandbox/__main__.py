"""``python -m devs_sandbox`` is the ``devs-sandbox`` command."""

from devs_sandbox.cli import main

raise SystemExit(main())
