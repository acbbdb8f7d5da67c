"""The ``memfine`` command line: :mod:`memfine.cli.main` and one module per subcommand.

Each subcommand module (``train``, ``generate``, ``evaluate``, ``export``, ``bench`` and the
``plan`` package) has ``add_arguments(parser)`` and ``run(args) -> int``; ``main`` imports only
the one a command line names.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
