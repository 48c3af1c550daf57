"""The float64 numpy reference: ground truth for tests and the CPU path of the model."""
from gptcuda.ops.reference import ops

__all__ = ["ops"]
