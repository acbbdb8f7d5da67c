"""The command-line flag tables behind ``memfine``'s commands and how they resolve to configs.

Modules: ``table`` (the one flag-table pattern: :class:`~memfine.flags.table.Flag`, parsing,
one-line usage errors), ``train_flags`` (``memfine train``'s table), ``train_config`` (flags,
``--config`` TOML, ``--resume`` and ``--init-from`` resolved into a ``TrainConfig``), ``budget``
(a ``--memory-budget`` that no plan meets, refused before the run), ``checkpoint`` (the
run-directory flags of ``generate`` / ``eval`` / ``export``).
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
