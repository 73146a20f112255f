"""The one place ``datasets/`` imports Dassl; without it, a one-line ImportError says what to do."""

try:
    from dassl.data.datasets import DATASET_REGISTRY, DatasetBase, Datum
except ImportError as err:  # ModuleNotFoundError included
    raise ImportError(
        f"Dassl is not installed ({err}): install Dassl.pytorch (github.com/KaiyangZhou/Dassl.pytorch) "
        "to use datasets/; meta.data.coop_data reads the same CoOp data without Dassl"
    ) from None

__all__ = ["DATASET_REGISTRY", "Datum", "DatasetBase"]
