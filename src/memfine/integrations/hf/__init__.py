"""The pieces behind :mod:`memfine.integrations.transformers`.

- :mod:`memfine.integrations.hf.experts`: run an HF experts module's weights on memfine's paths.
- :mod:`memfine.integrations.hf.gates`: the gated activations HF experts classes use.
- :mod:`memfine.integrations.hf.layout`: read an experts class's weight layout.
"""
