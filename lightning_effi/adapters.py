"""The adapters namespace (documented import path): the per-architecture adapters of :mod:`lightning_effi.models`."""

from lightning_effi.models import *  # noqa: F403
from lightning_effi.models import __all__  # noqa: F401
