"""The pieces behind :mod:`memfine.integrations.transformers`.

- :mod:`memfine.hf.experts`: run an HF experts module's weights on memfine's paths.
- :mod:`memfine.hf.gates`: the gated activations HF experts classes use.
- :mod:`memfine.hf.layout`: read an experts class's weight layout.
"""

__all__: list[str] = []  # the modules above are the public faces; nothing is re-exported
