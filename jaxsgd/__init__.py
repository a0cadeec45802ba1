"""jaxsgd: asynchronous and decoupled SGD in JAX/Flax/Optax."""

__version__ = '0.1.0'
