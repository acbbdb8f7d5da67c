"""The expert activations and their closed-form backward, recomputed from H (MoEBlaze §4).

:mod:`memfine.activations.functions`: the one table of named activations and gate functions,
the general gated form (:class:`memfine.config.GatedActivation`), forward and backward.
"""

from memfine.activations.functions import (
    ACTIVATIONS,
    GATE_FUNCTIONS,
    Activation,
    ActivationEntry,
    ElementwiseForm,
    GateFunction,
    activation_and_gate,
    activation_backward,
    apply_activation,
    check_activation,
    gated_name,
    is_gated,
)

__all__ = ["ACTIVATIONS", "GATE_FUNCTIONS", "Activation", "ActivationEntry", "ElementwiseForm",
           "GateFunction", "activation_and_gate", "activation_backward", "apply_activation",
           "check_activation", "gated_name", "is_gated"]
