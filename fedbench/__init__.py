"""fedbench: Bayesian / Laplace federated-learning benchmark suite."""
__version__ = "0.1.0"
