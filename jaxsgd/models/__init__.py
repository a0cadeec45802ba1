"""Flax models that can be cut into pipeline stages."""

from jaxsgd.models.staged import AuxHead
from jaxsgd.models.staged import balanced_boundaries
from jaxsgd.models.staged import check_num_stages
from jaxsgd.models.staged import init_stages
from jaxsgd.models.staged import merge_variables
from jaxsgd.models.staged import split
from jaxsgd.models.staged import Stage
from jaxsgd.models.staged import stage_variables
from jaxsgd.models.staged import StagedModel
from jaxsgd.models.zoo import get_model
from jaxsgd.models.zoo import MODELS
