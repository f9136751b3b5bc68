"""The tasks namespace (documented import path): the reference LightningModules of
:mod:`lightning_effi.reference.tasks`, which follow the per-sample-loss contract of ``docs/architecture.md``."""

from lightning_effi.reference.tasks import *  # noqa: F403
from lightning_effi.reference.tasks import __all__  # noqa: F401
