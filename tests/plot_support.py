"""Reading the PNG plots the commands write (no tests here): the image's pixels, and how many of them
carry one exact colour, so that a test can check a plot's size and which curves or cells it drew."""
from __future__ import annotations

import numpy as np


def read_png(path) -> np.ndarray:
    """The image as an (height, width, 3) uint8 RGB array."""
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def cycle_colour(i: int) -> tuple[int, int, int]:
    """Matplotlib's default colour for the i-th line of an axes (C0, C1, ...), as RGB bytes."""
    from matplotlib.colors import to_rgb

    return tuple(round(255 * c) for c in to_rgb(f"C{i}"))


def colormap_colour(name: str, value: float) -> tuple[int, int, int]:
    """The RGB bytes a colormap gives ``value`` in [0, 1] (as imshow with vmin 0, vmax 1 paints it)."""
    import matplotlib

    return tuple(round(255 * c) for c in matplotlib.colormaps[name](value)[:3])


def pixels_of(image: np.ndarray, rgb: tuple[int, int, int]) -> int:
    """How many pixels have exactly this colour."""
    return int((image == np.asarray(rgb, dtype=np.uint8)).all(-1).sum())
