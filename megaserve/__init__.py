"""megaserve package."""

import glob
import importlib.util
import os

# libtpu (the `tpu` extra, used for AOT compilation on CPU) makes JAX probe for a TPU at start
# and print pages of warnings on machines without one; pick the CPU unless a TPU is attached.
if (
    "JAX_PLATFORMS" not in os.environ
    and importlib.util.find_spec("libtpu") is not None
    and not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
):
    os.environ["JAX_PLATFORMS"] = "cpu"
