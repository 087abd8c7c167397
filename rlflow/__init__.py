"""rlflow: functional, distributed RL training of LLMs on PyTorch."""

__version__ = "0.1.0"
