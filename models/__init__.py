"""Model zoo: name -> builder of an uncompiled Keras model that outputs logits."""

from models.flops import flops_per_example
from models.registry import ModelSpec, get_model_spec, model_names

__all__ = ["ModelSpec", "flops_per_example", "get_model_spec", "model_names"]
