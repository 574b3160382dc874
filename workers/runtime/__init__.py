"""What runs a job's ranks: the ``Runtime`` seam (``base``) and its Ray Train implementation (``ray_train``)."""

from workers.runtime.base import Runtime

__all__ = ["Runtime"]
