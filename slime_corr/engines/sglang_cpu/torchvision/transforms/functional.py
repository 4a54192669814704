"""``torchvision.transforms.functional`` stand-in."""

from torchvision.transforms import InterpolationMode, __getattr__  # noqa: F401
