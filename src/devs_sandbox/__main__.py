"""``python -m devs_sandbox`` is the ``devs-sandbox`` command."""

from devs_sandbox.cli.fast import main

raise SystemExit(main())
