"""The toolset distributions and the per-prompt sampler, as a public entry point: see trajgen/distributions.py."""
from trajgen.distributions import DISTRIBUTIONS, TOOLSETS, Distribution, get_distribution, sample_toolsets

__all__ = ["DISTRIBUTIONS", "TOOLSETS", "Distribution", "get_distribution", "sample_toolsets"]
