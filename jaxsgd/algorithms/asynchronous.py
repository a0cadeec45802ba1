"""`asgd`, `dcasgd`, `lppsgd`, `pdasgd`: the asynchronous algorithms of `jaxsgd.asynchronous`.

    asgd    parameter server + M workers, w ← w − η g (Hogwild!-style); optional
            staleness-scaled learning rate (`algorithm.staleness_lr`)
    dcasgd  the same with delay compensation (Zheng et al. 2017, arXiv:1609.08326)
    lppsgd  Hogwild! workers per device, replicas averaged across devices (the
            baseline of Teguemne Fokam et al. 2024, arXiv:2410.05985)
    pdasgd  forward and backward workers, layer-wise updates (arXiv:2410.05985)

Each module's docstring gives the update rule and the schedule; this one only
registers them (`validate` refuses bad settings before anything compiles).
"""

from jaxsgd.algorithms import Algorithm
from jaxsgd.asynchronous import lppsgd
from jaxsgd.asynchronous import pdasgd
from jaxsgd.asynchronous import server

ALGORITHMS = {
    'asgd': Algorithm('asgd', server.check_config, server.train, uses_workers=True),
    'dcasgd': Algorithm('dcasgd', server.check_config, server.train, uses_workers=True),
    'lppsgd': Algorithm('lppsgd', lppsgd.check_config, lppsgd.train),
    'pdasgd': Algorithm('pdasgd', pdasgd.check_config, pdasgd.train),
}
