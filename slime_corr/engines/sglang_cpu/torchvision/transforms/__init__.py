"""``torchvision.transforms`` stand-in: any attribute is a placeholder that raises when used."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"torchvision.transforms.{name}: CPU stand-in (slime_corr/engines/sglang_cpu)")

    return unavailable
