"""`specjax.timing.interleaved`: the arms of a comparison take turns, repeat after repeat."""

import time

import numpy as np
import pytest

from specjax.timing import interleaved


def test_arms_take_turns_and_none_is_always_first():
  order = []
  seconds, outputs = interleaved([lambda r, i=i: order.append((r, i)) or 10 * r + i
                                  for i in range(3)], repeats=3)
  assert order == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]
  assert outputs == [[0, 10, 20], [1, 11, 21], [2, 12, 22]]
  assert [s.shape for s in seconds] == [(3,)] * 3 and all((s >= 0).all() for s in seconds)


def test_runs_until_every_arm_has_spent_its_seconds():
  fast = lambda r: time.sleep(0.002)
  slow = lambda r: time.sleep(0.01)
  seconds, _ = interleaved([slow, fast], repeats=2, seconds=0.05)
  assert len(seconds[0]) == len(seconds[1])  # whole repeats only
  assert seconds[0].sum() >= 0.05 and seconds[1].sum() >= 0.05
  assert len(seconds[1]) > 5  # the fast arm's budget decides
  ratio = np.median(seconds[0] / seconds[1])
  assert ratio > 1.0


@pytest.mark.parametrize("fns, repeats, seconds", [([], 1, 0.0), ([lambda r: r], 0, 0.0),
                                                   ([lambda r: r], 1, -1.0)])
def test_refuses_what_it_cannot_time(fns, repeats, seconds):
  with pytest.raises(ValueError, match="interleaved needs"):
    interleaved(fns, repeats, seconds)
