"""Supervised training: the policy's next-token and draft-head losses and step (`step`), and
offline EAGLE-3 training on the target's own text (`eagle3`)."""

from specjax.supervised.eagle3 import (Eagle3TrainState, draft_vocab_from_data, eagle3_loss,
                                       init_eagle3_state, make_eagle3_step, self_distillation_data,
                                       target_features, train_eagle3)
from specjax.supervised.step import (SupervisedState, draft_head_loss, init_supervised_state,
                                     lm_loss, make_supervised_step, shifted_cross_entropy)

__all__ = [
    "draft_head_loss", "draft_vocab_from_data", "eagle3_loss", "Eagle3TrainState",
    "init_eagle3_state", "init_supervised_state", "lm_loss", "make_eagle3_step",
    "make_supervised_step", "self_distillation_data", "shifted_cross_entropy", "SupervisedState",
    "target_features", "train_eagle3",
]
