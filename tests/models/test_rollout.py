"""Batched generation for rollouts (`jqlora.models.rollout.generate_batch`): rows of mixed prompt
lengths against each prompt generated alone, per-row stop tokens, reproducible sampling, the
log-probabilities against a full forward pass, and one compilation per bucket."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import models
from jqlora.errors import SettingError
from jqlora.models import rollout
from jqlora.models.rollout import generate_batch
from test_scan import _model

N = 7  # new tokens
PROMPTS = [[3, 17, 99, 5, 42, 8, 61, 23, 77], [11, 64], [120, 2, 9, 33, 50]]  # 3 rows: bucket 4, one padding row


@pytest.fixture(scope="module")
def m():
    """Two NF4 layers with LoRA (B non-zero) unmerged, float32 compute."""
    return _model(2)


@pytest.fixture(scope="module")
def greedy(m):
    return generate_batch(m, PROMPTS, N, key=None, temperature=0.0, return_logprobs=True)


_forward = nnx.jit(lambda m, ids, seg: m(ids, segment_ids=seg))


def _alone(m, p, n=N, width=9):
    """`generate()` on the one prompt (a batch of one), left-padded to `width` so that every prompt
    shares one compiled program."""
    ids, mask = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
    ids[0, width - len(p):], mask[0, width - len(p):] = p, 1
    return np.asarray(models.generate(m, ids, n, attention_mask=mask))[0, width:]


def _full_forward_logprobs(m, prompts, r):
    """log_softmax of one cache-free forward over each prompt + completion (right-padded rows,
    padding in segment 0) at the tokens chosen: what a policy-gradient loss recomputes."""
    seqs = [list(p) + r.tokens[i, :r.lengths[i]].tolist() for i, p in enumerate(prompts)]
    ids = np.zeros((len(seqs), 32), np.int32)  # one width: one compilation
    seg = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], seg[i, :len(s)] = s, 1
    logits = _forward(m, jnp.asarray(ids), jnp.asarray(seg))
    lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    ref = np.zeros(r.tokens.shape, np.float32)
    for i, p in enumerate(prompts):
        for j in range(r.lengths[i]):
            ref[i, j] = lp[i, len(p) - 1 + j, r.tokens[i, j]]
    return ref


def test_greedy_batch_equals_each_prompt_alone(m, greedy):
    r = greedy
    assert r.tokens.shape == (3, N) and r.tokens.dtype == np.int32
    for i, p in enumerate(PROMPTS):
        np.testing.assert_array_equal(r.tokens[i], _alone(m, p), err_msg=f"row {i}")
    np.testing.assert_array_equal(r.lengths, [N] * 3)
    assert not r.finished.any() and r.steps == N
    np.testing.assert_array_equal(r.prompt_lengths, [9, 2, 5])
    assert len({tuple(t) for t in r.tokens}) == 3  # the rows differ: the prompts matter
    assert r.completions() == [t.tolist() for t in r.tokens]


def test_greedy_logprobs_equal_a_full_forward(m, greedy):
    np.testing.assert_allclose(greedy.logprobs, _full_forward_logprobs(m, PROMPTS, greedy), rtol=0, atol=2e-5)
    assert (greedy.logprobs < 0).all()


def test_hoisted_layers_with_fused_projections_give_the_same_rollouts(m, greedy):
    """On a CPU `auto` scans the layers; on a GPU rollouts hoist them and fuse q|k|v and gate|up
    (`DecoderLayer.fuse_projections`): the tokens and log-probabilities must not change."""
    r = generate_batch(m, PROMPTS, N, key=None, temperature=0.0, return_logprobs=True, decode_layers="hoisted")
    np.testing.assert_array_equal(r.tokens, greedy.tokens)
    np.testing.assert_allclose(r.logprobs, greedy.logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("how", ["scanned", "hoisted"])
def test_rollouts_through_the_decode_attention_kernel(how, greedy, monkeypatch):
    """On a GPU each decoding step's attention runs the `decode_attention` kernel
    (`jqlora.ops.cached_attention`); here in interpret mode: a padding row and rows of three
    prompt lengths give the same tokens and log-probabilities as the einsum path."""
    from decode_kernel_calls import record_kernel_calls

    calls = record_kernel_calls(monkeypatch)
    k = _model(2)
    k.backend = "interpret"
    r = generate_batch(k, PROMPTS, N, key=None, temperature=0.0, return_logprobs=True, decode_layers=how)
    assert calls, "the kernel did not run"
    np.testing.assert_array_equal(r.tokens, greedy.tokens)
    np.testing.assert_allclose(r.logprobs, greedy.logprobs, rtol=0, atol=2e-5)


def test_stop_tokens_end_each_row_and_pad_after(m, greedy):
    g = greedy.tokens
    eos, stop, pad = int(g[0, 2]), int(g[1, 4]), 127
    r = generate_batch(m, PROMPTS, N, key=None, temperature=0.0, eos_token_id=eos, stop_token_ids=[stop],
                       pad_token_id=pad, return_logprobs=True)
    for i in range(3):
        hits = [j for j in range(N) if g[i, j] in (eos, stop)]
        n = hits[0] + 1 if hits else N
        assert r.lengths[i] == n and r.finished[i] == bool(hits), (i, r.lengths, r.finished)
        np.testing.assert_array_equal(r.tokens[i, :n], g[i, :n])
        assert (r.tokens[i, n:] == pad).all() and (r.logprobs[i, n:] == 0).all()
        np.testing.assert_allclose(r.logprobs[i, :n], greedy.logprobs[i, :n], rtol=0, atol=1e-6)
    assert r.finished[0] and r.steps == max(r.lengths)
    # every row stopping at its first token ends the loop there: one position run
    firsts = sorted({int(t) for t in g[:, 0]})
    r1 = generate_batch(m, PROMPTS, N, key=None, temperature=0.0, stop_token_ids=firsts, pad_token_id=pad,
                        return_logprobs=True)
    assert r1.steps == 1 and r1.finished.all() and (r1.lengths == 1).all()
    assert (r1.tokens[:, 1:] == pad).all()


def test_sampling_is_reproducible_per_row_and_logprobs_are_the_raw_models(m):
    kw = dict(temperature=1.5, top_p=0.9, return_logprobs=True)
    a = generate_batch(m, PROMPTS, N, key=jax.random.key(1), **kw)
    b = generate_batch(m, PROMPTS, N, key=jax.random.key(1), **kw)
    c = generate_batch(m, PROMPTS, N, key=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # one more prompt in the batch (same bucket): the first rows draw the same tokens
    d = generate_batch(m, PROMPTS + [[7, 7, 7]], N, key=jax.random.key(1), **kw)
    np.testing.assert_array_equal(d.tokens[:3], a.tokens)
    assert not np.array_equal(a.tokens, generate_batch(m, PROMPTS, N, key=None, temperature=0.0,
                                                       return_logprobs=True).tokens)  # really sampled
    # the log-probabilities are the model's at temperature 1, before top-p, not the sampler's
    np.testing.assert_allclose(a.logprobs, _full_forward_logprobs(m, PROMPTS, a), rtol=0, atol=2e-5)


def test_dropping_finished_rows_changes_no_token(m, monkeypatch):
    """Four rows, two of them stopping at their first token, decode calls of 2 steps: the two live
    rows continue in a batch of 2 (a new decode program) with the same tokens and log-probabilities
    as when every slot runs to the end in one call."""
    prompts = PROMPTS + [[40, 41, 42, 43]]
    g = generate_batch(m, prompts, N, key=None, temperature=0.0, return_logprobs=True).tokens
    stops = sorted({int(g[1, 0]), int(g[2, 0])})
    kw = dict(key=None, temperature=0.0, stop_token_ids=stops, return_logprobs=True, decode_chunk=2)
    full = generate_batch(m, prompts, N, compact=False, **kw)  # one decode call, every slot to the end
    assert list(full.lengths > 3) == [True, False, False, True], "pick other stop ids"
    monkeypatch.setattr(rollout, "COMPACT_MIN_ROWS", 4)
    chunked = generate_batch(m, prompts, N, compact=True, **kw)  # calls of 2 steps, all 4 slots to the end
    np.testing.assert_array_equal(chunked.tokens, full.tokens)
    monkeypatch.setattr(rollout, "COMPACT_MIN_ROWS", 2)
    before = rollout.compiled_programs()
    small = generate_batch(m, prompts, N, compact=True, **kw)
    assert rollout.compiled_programs() == before + 1  # the 2-slot bucket's decode program: it compacted
    np.testing.assert_array_equal(small.tokens, full.tokens)
    np.testing.assert_array_equal(small.lengths, full.lengths)
    np.testing.assert_array_equal(small.finished, full.finished)
    np.testing.assert_allclose(small.logprobs, full.logprobs, rtol=0, atol=1e-5)  # batch size: rounding


def test_prompts_of_other_lengths_in_the_same_bucket_do_not_compile(m):
    """Three rows (batch bucket 4) of prompts up to 64 tokens (one prompt bucket): the first call
    has the bucket's programs compiled (or finds them); calls with other lengths, or the rows in
    another order, compile nothing more. Counted within the test: between tests the conftest's
    mapping guard may clear every jit cache."""
    prompts = [[5] * 30, [9, 8, 7, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    r = generate_batch(m, prompts, N - 2, key=None, temperature=0.0, return_logprobs=True)
    before = rollout.compiled_programs()
    assert before >= 2  # a prefill and a decode program
    other = generate_batch(m, [[7] * 9, [3, 4], [6] * 57], N - 2, key=None, temperature=0.0, return_logprobs=True)
    back = generate_batch(m, prompts[::-1], N - 2, key=None, temperature=0.0, return_logprobs=True)
    assert rollout.compiled_programs() == before
    assert r.tokens.shape == (3, N - 2) and other.tokens.shape == (3, N - 2)
    np.testing.assert_array_equal(back.tokens, r.tokens[::-1])  # a row's tokens do not depend on its place


def test_buckets():
    assert [rollout.batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65, 130)] == [1, 2, 4, 8, 8, 16, 64, 64,
                                                                                      128, 192]
    assert [rollout.prompt_bucket(n) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 192]


def test_greedy_matches_transformers_on_the_same_weights():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
    torch.manual_seed(0)
    tm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0))
    params = {k: v.numpy() for k, v in tm.state_dict().items()}
    jm = models.from_params(params, {"model_type": "llama", **cfg}, compute_dtype=jnp.float32)
    prompts = [[4, 80, 15, 33, 2, 61, 9], [50, 3]]
    r = generate_batch(jm, prompts, 6, key=None, temperature=0.0)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = tm.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        np.testing.assert_array_equal(r.tokens[i], out[0, len(p):].numpy(), err_msg=f"row {i}")


@pytest.mark.parametrize("call, match", [
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1, 500]]), "prompt 0 has token id 500"),
    (dict(prompts=[[1]], temperature=1.0, key=None), "needs key"),
    (dict(prompts=[[1]], top_p=0.0), "top_p"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1]], pad_token_id=-1), "pad_token_id"),
])
def test_bad_arguments_name_what_is_wrong(m, call, match):
    kw = {"max_new_tokens": 2, "key": jax.random.key(0), **call}
    with pytest.raises(SettingError, match=match):
        generate_batch(m, kw.pop("prompts"), kw.pop("max_new_tokens"), **kw)
