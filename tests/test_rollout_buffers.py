"""The rollout engine's buffers and copies: uninitialized KV buffers are never read, the prefill and a drop of
finished rows copy in few calls, and none of it changes a token or a log-prob."""
import numpy as np
import paddle
import pytest

from paddle_rl import ops
from paddle_rl.bench import ForcedLengths
from paddle_rl.models import CausalLM, ModelConfig
from paddle_rl.models.decoder import LayerCache
from paddle_rl.rollout import RolloutEngine, SamplingParams, engine as engine_module, running, sample_key
from paddle_rl.rollout.running import RunningBatch
from paddle_rl.rollout.sequence import Sequence

# prompts of four lengths (one prefill pass each), a duplicate among them
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23], [30, 31], [5, 6, 7, 8, 9], [40, 41, 42]]
N = 4


@pytest.fixture(scope="module")
def model():
    paddle.seed(11)
    m = CausalLM(ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2))
    m.init_weights(0.2)
    m.eval()
    return m


@pytest.fixture
def kernels():
    previous = ops.mode()
    ops.configure("auto")
    if not ops.available():
        pytest.skip("the fused kernels are not in use")
    yield
    ops.configure(previous)


def rollout(model, kv_cache_dtype=None, **limits):
    """Rows of different lengths (a forced schedule: rows leave in runs and alone, waiting prompts join)."""
    keys = [sample_key(5, 0, i // N, i % N) for i in range(len(PROMPTS) * N)]
    lengths = {tuple(k.tolist()): 3 + (7 * i) % 23 for i, k in enumerate(keys)}
    engine = RolloutEngine(model, 0, [1], stages=[ForcedLengths(lambda ks: [lengths[tuple(k.tolist())] for k in ks])],
                           kv_cache_dtype=kv_cache_dtype, **limits)
    out = engine.generate(PROMPTS, N, SamplingParams(max_dec_len=32, temperature=1.0), keys)
    return out, engine.stats


def poison_uninitialized(monkeypatch):
    """paddle.empty gives NaN-filled float tensors: anything that reads a slot before it is written reads a NaN."""
    empty = paddle.empty

    def poisoned(shape, dtype=None, name=None):
        out = empty(shape, dtype)
        if out.dtype in (paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64):
            out = paddle.full(shape, float("nan"), out.dtype)
        return out
    monkeypatch.setattr(paddle, "empty", poisoned)


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
def test_uninitialized_buffers_are_never_read(model, kernels, monkeypatch, kv_cache_dtype):
    """With the decode kernel the cache buffers are not zeroed (it reads each row's window only, written first):
    the same tokens and log-probs when every uninitialized slot holds NaN."""
    clean, stats = rollout(model, kv_cache_dtype, max_num_seqs=12)
    assert stats["prefills"] > 1 and stats["relayouts"] > 5
    poison_uninitialized(monkeypatch)
    poisoned, _ = rollout(model, kv_cache_dtype, max_num_seqs=12)
    assert np.isfinite(poisoned.rollout_logp).all()
    np.testing.assert_array_equal(poisoned.response_ids, clean.response_ids)
    np.testing.assert_array_equal(poisoned.rollout_logp, clean.rollout_logp)


def test_reference_attention_gets_zeroed_buffers(model, monkeypatch):
    """The reference decode attention reads every slot below the step's (the ones before a row's start masked), so
    without the kernels the engine zeroes its buffers: the poisoned run equals the clean one, and forcing the
    buffers uninitialized there does reach its log-probs."""
    previous = ops.mode()
    ops.configure("off")
    try:
        clean, _ = rollout(model, max_num_seqs=12)
        poison_uninitialized(monkeypatch)
        poisoned, _ = rollout(model, max_num_seqs=12)
        np.testing.assert_array_equal(poisoned.rollout_logp, clean.rollout_logp)
        monkeypatch.setattr(ops, "decode_attention_reads_windows", lambda *dtypes: True)
        forced, _ = rollout(model, max_num_seqs=12)
        assert np.isnan(forced.rollout_logp).any()
    finally:
        ops.configure(previous)


def count_kv_place(monkeypatch):
    """The engine's and the running batch's kv_place calls, counted (each still runs)."""
    calls = []
    place = running.kv_place

    def counting(*args):
        calls.append(args)
        return place(*args)
    monkeypatch.setattr(running, "kv_place", counting)
    monkeypatch.setattr(engine_module, "kv_place", counting)
    return calls


def test_prefill_places_each_prompt_length_at_once(model, monkeypatch):
    """One prefill of prompts of four lengths: one copy per length, layer, keys and values into the prefill caches,
    then one per layer, keys and values into the running batch (not one per prompt)."""
    calls = count_kv_place(monkeypatch)
    engine = RolloutEngine(model, 0, [1])
    engine.generate(PROMPTS, N, SamplingParams(max_dec_len=1, temperature=0.0))
    layers, lengths = len(model.layers), len({len(p) for p in PROMPTS})
    assert engine.stats["prefills"] == 1
    assert len(calls) == 2 * layers * lengths + 2 * layers


@pytest.mark.parametrize("keep, order, runs", [
    ([0, 4, 5, 7, 8, 9], [0, 7, 8, 9, 4, 5], 1),    # holes 1, 2, 3 <- rows 7, 8, 9: one run
    ([0, 2, 5, 6, 7, 9], [0, 6, 2, 7, 9, 5], 2),    # holes 1 <- 6 and 3, 4 <- 7, 9: two runs
])
def test_drop_moves_runs_of_rows_in_one_copy(monkeypatch, keep, order, runs):
    """Rows leave a batch of 10: the last kept rows move into the holes before them, a run of consecutive holes in
    one copy per layer, keys and values (after one copy of the moving rows into a scratch buffer), and every kept
    row keeps its window and its per-row state."""
    rows, kv, capacity, d, layers = 10, 2, 8, 4, 2
    batch = RunningBatch(layers, max_dec_len=4)
    rng = np.random.default_rng(0)
    for layer in batch.layers:
        layer.k = paddle.to_tensor(rng.standard_normal((rows, kv, capacity, d)).astype(np.float32))
        layer.v = paddle.to_tensor(rng.standard_normal((rows, kv, capacity, d)).astype(np.float32))
        layer.length, layer.capacity = 6, capacity
    before = [(layer.k.numpy().copy(), layer.v.numpy().copy()) for layer in batch.layers]
    batch.seqs = [Sequence(r, r, 0, [1] * 3, None) for r in range(rows)]
    starts = np.array([3, 2, 3, 1, 3, 2, 3, 3, 2, 3], dtype=np.int64)
    batch.start = starts.copy()
    batch.prompt_lengths = np.full(rows, 3, dtype=np.int64)
    batch.generated = np.arange(rows, dtype=np.int64)
    batch.last = np.arange(rows, dtype=np.int64) + 100
    calls = count_kv_place(monkeypatch)
    batch.drop(np.array(keep, dtype=np.int64))
    assert len(calls) == layers * 2 * (1 + runs)
    assert [s.row for s in batch.seqs] == order
    assert batch.start.tolist() == starts[order].tolist()
    assert batch.generated.tolist() == order and batch.last.tolist() == [r + 100 for r in order]
    for layer, (k, v) in zip(batch.layers, before):
        assert layer.k.shape[0] == len(keep)
        for new, old in enumerate(order):
            start = int(batch.start[new])
            np.testing.assert_array_equal(layer.k.numpy()[new, :, start:6], k[old, :, start:6])
            np.testing.assert_array_equal(layer.v.numpy()[new, :, start:6], v[old, :, start:6])


def test_layer_cache_growth_keeps_written_slots(monkeypatch):
    """LayerCache buffers grow uninitialized (here NaN): the slots written so far are copied over, the later ones
    written before they are returned."""
    poison_uninitialized(monkeypatch)
    cache = LayerCache()
    first = paddle.randn([2, 1, 3, 4])
    cache.update(first, first * 2)
    more = paddle.randn([2, 1, 5, 4])
    keys, values = cache.update(more, more * 2)
    assert keys.shape == [2, 1, 8, 4] and cache.k.shape[2] == 8
    np.testing.assert_array_equal(keys.numpy(), np.concatenate([first.numpy(), more.numpy()], axis=2))
    np.testing.assert_array_equal(values.numpy(), 2 * np.concatenate([first.numpy(), more.numpy()], axis=2))


@pytest.mark.parametrize("limits", [{}, {"max_num_seqs": 9}])   # all prompts at once; two at a time, joining later
def test_the_samples_of_a_prompt_read_its_slots_from_one_row(model, kernels, monkeypatch, limits):
    """Each decode step names, for every row, the first row placed from the same prefill row (a prompt's samples,
    not another group with the same prompt) and where its prompt ends; the tokens and log-probs are those of every
    row reading its own copy."""
    made = []
    shared_tensor = RunningBatch.shared_tensor

    def record(batch):
        out = shared_tensor(batch)
        made.append((list(batch.seqs), batch.start.copy(), None if out is None else out.numpy().copy()))
        return out
    monkeypatch.setattr(RunningBatch, "shared_tensor", record)
    out, _ = rollout(model, **limits)
    assert made
    for seqs, start, shared in made:
        groups = [s.group for s in seqs]
        if shared is None:   # no two rows of a prompt left
            assert len(set(groups)) == len(groups)
            continue
        for r, (source, end) in enumerate(shared):
            assert source == groups.index(groups[r])
            assert end == start[r] + len(seqs[r].prompt)
    assert any(shared is not None and (shared[:, 0] != np.arange(len(shared))).any() for _, _, shared in made)
    monkeypatch.setattr(RunningBatch, "shared_tensor", lambda batch: None)
    alone, _ = rollout(model, **limits)
    np.testing.assert_array_equal(out["response_ids"], alone["response_ids"])
    np.testing.assert_array_equal(out["rollout_logp"], alone["rollout_logp"])
