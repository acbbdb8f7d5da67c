"""Backends for other frameworks; import the submodule you need (nothing is imported here).

- :mod:`memfine.integrations.transformers`: ``experts_implementation="memfine"`` for HF
  transformers MoE models (extra ``memfine[hf]``; transformers is imported by ``register()``).
- :mod:`memfine.integrations.torchtitan`: ``convert_model`` / ``converter`` run torchtitan MoE
  models' routed experts with memfine (extra ``memfine[torchtitan]``; torchtitan is imported by
  those functions, through :mod:`memfine.integrations.torchtitan_modules`).
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
