"""The ``devs-sandbox`` command line (``cli/main.py``) and its fast path for ``run``
(``cli/fast.py`` and the local server ``cli/server.py``). Nothing here is imported by the
library: the CLI is a shell over it."""
