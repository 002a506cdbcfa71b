"""Bring images of any stored size to the (H, W, C) a model asks for, so that
every source can feed every model."""

from __future__ import annotations

import tensorflow as tf

from input.errors import DataError


def fit_images(images: tf.Tensor, image_shape: tuple[int, int, int]) -> tf.Tensor:
    """Resize (bilinear) and convert channels of float images in [0, 1].

    Works on one image (h, w, c) or a batch (n, h, w, c). Grayscale becomes
    RGB by repeating the channel and RGB becomes grayscale by luminance; other
    channel changes are refused. Spatial sizes may be dynamic (decoded files).
    """
    height, width, channels = image_shape
    size = tf.shape(images)[-3:-1]
    # Bilinear weights are convex, but float rounding can leave [0, 1] by an ulp.
    images = tf.cond(
        tf.reduce_all(size == [height, width]),
        lambda: images,
        lambda: tf.clip_by_value(tf.image.resize(images, [height, width]), 0.0, 1.0),
    )
    stored = images.shape[-1]
    if stored != channels:  # after resizing: repeating channels is then cheaper
        if stored == 1:
            images = tf.repeat(images, channels, axis=-1)
        elif stored == 3 and channels == 1:
            images = tf.image.rgb_to_grayscale(images)
        else:
            raise DataError(
                f"cannot convert images with {stored} channels to {channels}; "
                "use an image shape with 1 or 3 channels"
            )
    return tf.ensure_shape(images, [*images.shape[:-3], height, width, channels])
