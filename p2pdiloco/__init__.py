"""p2pdiloco: peer-to-peer volunteer pre-training with the DiLoCo family."""

__version__ = "0.1.0"
