"""Backends for other frameworks; import the submodule you need (nothing is imported here).

- :mod:`memfine.integrations.transformers`: ``experts_implementation="memfine"`` for HF
  transformers MoE models (extra ``memfine[hf]``; transformers is imported by ``register()``).
"""
