"""Model zoo: name -> builder of an uncompiled Keras model that outputs logits."""

from models.fits import check_fits_data
from models.flops import flops_per_example, known_flops_per_example
from models.registry import (
    USER_MODEL_INPUT_SHAPE,
    ModelError,
    ModelSpec,
    get_model_spec,
    is_user_model,
    model_names,
)
from models.standardize import Standardization, set_table_statistics, standardized

__all__ = [
    "USER_MODEL_INPUT_SHAPE",
    "ModelError",
    "ModelSpec",
    "flops_per_example",
    "known_flops_per_example",
    "get_model_spec",
    "is_user_model",
    "model_names",
    "check_fits_data",
    "Standardization",
    "set_table_statistics",
    "standardized",
]
