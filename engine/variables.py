"""The variables and regularization losses of any model: a Keras model, a
`tf.Module`, or either one holding the other, nested to any depth.

Neither framework sees the other's variables: `tf.Module.trainable_variables`
skips Keras 3 variables (they are not `tf.Variable`s), and a Keras layer
does not list the variables of a `tf.Module` it holds. A research model
that wraps a `keras.Sequential` in a `tf.Module` would otherwise report no
variables, and the step would compute no gradients without a word. The
step, the scope check, optimizer building and the checkpoint all ask here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf

from engine.compat import keras_sublayers, module_leaves
from engine.errors import UserError

Variable = Any  # A tf.Variable or a keras.Variable.


def trainable_variables(model: Any) -> list[Variable]:
    """Every trainable variable of `model`, each once, in a stable order."""
    return _collect(model, trainable_only=True)


def all_variables(model: Any) -> list[Variable]:
    """Every variable of `model` (trainable or not), each once."""
    return _collect(model, trainable_only=False)


def require_trainable_variables(model: Any) -> list[Variable]:
    """`trainable_variables(model)`, refusing a model that has none (nothing would train)."""
    variables = trainable_variables(model)
    if not variables:
        raise UserError(
            f"the model ({type(model).__name__}) has no trainable variables: build it (call it "
            "once on a batch, or give its first layer an input shape) inside strategy.scope() "
            "before passing it to Trainer"
        )
    return variables


def random_state_variables(model: Any) -> list[Variable]:
    """The random-number state of the model's Keras layers (each `SeedGenerator`'s state:
    Dropout, GaussianNoise, the augmentation layers, ...), in a stable order.

    Keras lists it in `layer.variables` but not in `layer.weights`, and a
    `tf.train.Checkpoint` of the model does not reach it: without it a resumed
    run would draw the same dropout masks again from the start seed.
    """
    found: dict[int, Variable] = {}
    for root in keras_roots(model):
        weights = {id(w) for w in root.weights}
        for variable in root.variables:
            if id(variable) not in weights:
                found.setdefault(id(variable), variable)
    return list(found.values())


def regularization_losses(model: Any) -> list[Any]:
    """Every regularization loss of `model` (weight regularizers and `add_loss` terms of
    its last call), each Keras layer counted once however it is reached."""
    roots = keras_roots(model)
    covered = {id(sub) for root in roots for sub in keras_sublayers(root)}
    return [loss for root in roots if id(root) not in covered for loss in root.losses]


def keras_roots(model: Any) -> list[keras.layers.Layer]:
    """The Keras layers the walk reaches that no reached Keras layer lists as its own sublayer
    through Keras itself: each one's `losses` covers its Keras sublayers."""
    walk = _Walk(trainable_only=False)
    walk.visit(model)
    return list(walk.keras_layers.values())


def check_regularizers_visible(model: Any) -> None:
    """Refuses a model with a regularized variable that no reached Keras layer answers for
    (its penalty would be dropped in silence)."""
    covered = {id(v) for root in keras_roots(model) for v in root.trainable_weights}
    hidden = [
        v
        for v in trainable_variables(model)
        if getattr(v, "regularizer", None) is not None and id(v) not in covered
    ]
    if hidden:
        raise UserError(
            f"variable {hidden[0].name!r} of the model ({type(model).__name__}) has a regularizer that no "
            "Keras layer of the model reports, so its penalty would not be trained: keep the layer as an "
            "attribute of the model, or add the penalty to the loss in a step_fn"
        )


def _collect(model: Any, *, trainable_only: bool) -> list[Variable]:
    walk = _Walk(trainable_only=trainable_only)
    walk.visit(model)
    return list(walk.found.values())


class _Walk:
    """One walk over a model: the variables found (each once, in a stable order) and the
    Keras layers it reached by itself (the ones whose `losses` no other reached layer covers)."""

    def __init__(self, *, trainable_only: bool):
        self.trainable_only = trainable_only
        self.found: dict[int, Variable] = {}
        self.keras_layers: dict[int, keras.layers.Layer] = {}
        self._seen: set[int] = set()

    def visit(self, node: Any) -> None:
        if id(node) in self._seen:
            return
        self._seen.add(id(node))
        if isinstance(node, keras.layers.Layer):
            self.keras_layers.setdefault(id(node), node)
            for variable in node.trainable_variables if self.trainable_only else node.variables:
                self.found.setdefault(id(variable), variable)
            # A Keras layer lists its Keras sublayers' variables, not a tf.Module's it holds.
            for child in _attributes(node):
                if isinstance(child, tf.Module) or (isinstance(child, (list, tuple, dict)) and child):
                    self.visit_children(child)
        elif isinstance(node, tf.Module):
            # tf.Module's own walk of its attributes (and lists, dicts of them), stopping at
            # plain variables and at Keras layers, which answer for themselves above.
            for leaf in module_leaves(
                node, lambda value: isinstance(value, (tf.Variable, keras.Variable, keras.layers.Layer))
            ):
                if isinstance(leaf, keras.layers.Layer):
                    self.visit(leaf)
                else:
                    self._add(leaf)
        elif isinstance(node, (tf.Variable, keras.Variable)):
            self._add(node)
        else:
            self.visit_children(node)

    def visit_children(self, node: Any) -> None:
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            children = [node] if isinstance(node, (tf.Module, keras.layers.Layer)) else []
        for child in children:
            self.visit(child)

    def _add(self, variable: Variable) -> None:
        if not self.trainable_only or variable.trainable:
            self.found.setdefault(id(variable), variable)


def _attributes(layer: keras.layers.Layer) -> list[Any]:
    return [value for name, value in vars(layer).items() if not name.startswith("_")]
