"""Example tasks: LightningModules and LightningDataModules, generated on the fly."""

from .lm import CausalLMTask
from .recall import AssociativeRecallDataModule, make_recall_batch

__all__ = ["AssociativeRecallDataModule", "CausalLMTask", "make_recall_batch"]
