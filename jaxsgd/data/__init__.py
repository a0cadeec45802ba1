"""Datasets: one loading path, `tfds.data_source`, offline by default."""

from jaxsgd.data.pipeline import BatchIterator
from jaxsgd.data.pipeline import check_dataset_name
from jaxsgd.data.pipeline import Dataset
from jaxsgd.data.pipeline import KNOWN_DATASETS
from jaxsgd.data.pipeline import OFFLINE_DATASETS
from jaxsgd.data.pipeline import load
