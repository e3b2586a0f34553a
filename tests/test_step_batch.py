"""StepBatch's declared columns (paddle_rl/batch.py COLUMNS): names, shapes, dtypes and pads are checked where a
column is written, and a stage's needs are named where they are missing."""
import numpy as np
import pytest

from paddle_rl.batch import COLUMNS, RESPONSE_COLUMNS, StepBatch, rollout_batch


def _rollout(width=3, rows=2):
    ids = np.arange(rows * width, dtype=np.int64).reshape(rows, width)
    return rollout_batch([[1, 2]] * rows, ids, np.ones((rows, width), np.float32), np.zeros((rows, width), np.float32),
                         np.full(rows, width, np.int64), np.zeros(rows, bool), pad_id=7, group=[0] * rows,
                         sample=list(range(rows)))


def test_the_rollout_writes_declared_columns_and_every_token_column_pads():
    batch = _rollout()
    assert set(batch.columns) <= set(COLUMNS)
    assert all(COLUMNS[k].shape == "token" for k in RESPONSE_COLUMNS)
    wide = _rollout(width=5)
    wide["token_version"] = np.zeros((2, 5), np.int64)
    narrow = _rollout(width=3)
    narrow["token_version"] = np.zeros((2, 3), np.int64)
    both = StepBatch.concat([narrow, wide])
    assert both["response_ids"][0, 3:].tolist() == [7, 7]        # the batch's pad id
    assert both["token_version"][0, 3:].tolist() == [-1, -1]     # the declared pad
    assert both["rollout_logp"][0, 3:].tolist() == [0.0, 0.0]


def test_an_undeclared_or_misshapen_column_is_named():
    batch = _rollout()
    with pytest.raises(KeyError, match="'advantage' is not declared"):
        batch["advantage"] = np.zeros((2, 3), np.float32)        # a misspelt name
    with pytest.raises(ValueError, match="'advantages'.*declared float per token"):
        batch["advantages"] = np.zeros(2, np.float32)            # per row where per token is declared
    with pytest.raises(ValueError, match="'lengths'.*declared int per row"):
        batch["lengths"] = np.zeros(2, np.float32)
    batch["reward/format"] = np.ones(2, np.float32)              # a family declared by its prefix
    with pytest.raises(KeyError, match="'turn' is not declared"):
        batch.has("turn")
    assert not batch.has("turns") and batch.has("rollout_logp")


def test_a_stage_names_what_it_needs_and_who_adds_it():
    batch = _rollout()
    with pytest.raises(KeyError, match=r"the update needs step batch column\(s\) old_logp, advantages, added by "
                                        r"the old-policy pass .*; the advantage estimator"):
        batch.require(["response_mask", "old_logp", "advantages"], by="the update")
    batch.require(["response_ids", "group", "sample"], by="the rollout's readers")
