"""Flax models that can be cut into pipeline stages."""

from jaxsgd.models.split import AuxHead
from jaxsgd.models.split import balanced_boundaries
from jaxsgd.models.split import check_num_stages
from jaxsgd.models.split import init_stages
from jaxsgd.models.split import merge_variables
from jaxsgd.models.split import split
from jaxsgd.models.split import Stage
from jaxsgd.models.split import stage_variables
from jaxsgd.models.split import StagedModel
from jaxsgd.models.zoo import check_model_fields
from jaxsgd.models.zoo import get_model
from jaxsgd.models.zoo import MODELS
from jaxsgd.models.zoo import ModelSpec
