"""Stand-in for ``torchvision`` on CPU (see ``../sitecustomize.py``): enough for sglang's module-level imports of a
vision-language config; text models never call it."""
