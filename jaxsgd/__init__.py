"""jaxsgd: asynchronous and decoupled SGD in JAX/Flax/Optax.

import jaxsgd, optax
tx = optax.chain(jaxsgd.transforms.delay_compensation(lambda0=2.0, adaptive=True),
                 optax.sgd(0.1))
"""

from jaxsgd import transforms

__version__ = '0.1.0'
__all__ = ('transforms',)
