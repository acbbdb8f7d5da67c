"""The peer layers memfine is measured against, built on the same weights and routing.

- :mod:`memfine.baselines.layers`: every method's layer (memfine's paths, eager and grouped_mm
  experts, HF-style experts, compiled wrappers) behind one call signature.
- :mod:`memfine.baselines.titan_style`: a torchtitan-style ``_grouped_mm`` experts layer computing
  the same auxiliary losses.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
