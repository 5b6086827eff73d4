"""jqlora.train: data, optimizer, train loop, checkpoints (CPU). Gradient accumulation, resume and
the NaN guard run on jqlora's own Llama with NF4 weights (`nf4_llama`); data and checkpoint-format
tests use a tiny stub model."""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora import train as T
from jqlora.train import checkpoint as ckpt_mod
from jqlora.train import data as D
from jqlora.train import examples as E
from jqlora.train import loop
from jqlora.train import tokenization as TK

# ------------------------------------------------------------------------------------------------
# fixtures: a char-level tokenizer built on the fly, a tiny causal LM following the model contract
# ------------------------------------------------------------------------------------------------

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?"
SPECIALS = ["<pad>", "<s>", "</s>"]


def _make_tokenizer(path: Path) -> Path:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(ALPHABET) + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return _make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_path):
    return T.load_tokenizer(tok_path)


VOCAB = len(SPECIALS) + len(ALPHABET) + 1  # 35


@dataclasses.dataclass(frozen=True)
class StubConfig:  # hashable, so equal models share one compiled train step
    vocab_size: int


class StubLM(nnx.Module):
    """embedding (+ previous token within the segment) -> LoRALinear -> dropout -> head.

    Follows the contract: ``model(input_ids, *, positions, segment_ids, cache) -> (B, T, V)``."""

    def __init__(self, vocab_size=VOCAB, dim=32, rank=4, dropout=0.0, seed=0):
        rngs = nnx.Rngs(params=seed, dropout=seed + 100)
        self.config = StubConfig(vocab_size)
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.prev = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.proj = nnx.LoRALinear(dim, dim, lora_rank=rank, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, rngs=rngs)

    def __call__(self, input_ids, *, positions=None, segment_ids=None, cache=None):
        if segment_ids is None:
            segment_ids = jnp.ones_like(input_ids)
        prev_ids = jnp.pad(input_ids, ((0, 0), (1, 0)))[:, :-1]
        prev_seg = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
        same = ((prev_seg == segment_ids) & (segment_ids > 0))[..., None]
        h = self.embed(input_ids) + jnp.where(same, self.prev(prev_ids), 0.0)
        h = h + self.drop(jnp.tanh(self.proj(h)))
        return self.head(h)


LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def nf4_llama(dropout=0.0, seed=0):
    """jqlora's Llama (2 layers, NF4 weights with double quantization) with rank-4 LoRA on every
    projection; models of equal settings share one compiled train step."""
    from jqlora import lora, models

    params = models.init_params(LLAMA, seed=0, std=0.1)
    return models.from_params(params, LLAMA, quantize="nf4", compute_dtype=jnp.float32,
                              lora=lora.LoraConfig(rank=4, alpha=8.0, dropout=dropout),
                              rngs=nnx.Rngs(params=seed, dropout=seed + 100))


def lora_arrays(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))]


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def pattern_rows(n=24, seed=0):
    rng = np.random.default_rng(seed)
    words = ["abc", "hello", "the cat", "xyz", "go, go!"]
    out = []
    for i in range(n):
        w = words[i % len(words)]
        out.append({"text": " ".join([w] * int(rng.integers(1, 4)))})
    return out


def base_config(tmp_path, tok_path, data_path, **kw) -> T.TrainConfig:
    cfg = dict(data_path=str(data_path), tokenizer_path=str(tok_path), seq_len=32, batch_size=4,
               lr=1e-2, warmup=2, steps=6, seed=3, out_dir=str(tmp_path / "run"), save_every=0,
               log_every=1, progress=False, grad_clip=1.0)
    cfg.update(kw)
    return T.TrainConfig(**cfg)


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------

GOOD = {"text": "abc"}


@pytest.mark.parametrize("bad, needle", [
    ('{"text": "abc"', "invalid JSON"),
    ('{"prompt": "q"}', "missing field 'completion'"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"prompt": "q", "completion": ["a"]}', "'completion' must be a string"),
    ('{"text": ""}', "'text' is empty"),
    ('{"prompt": "q", "completion": "  "}', "'completion' is empty"),
    ("", "empty line"),
    ("[1, 2]", "expected a JSON object"),
    ('{"txt": "abc"}', "needs a 'text' field"),
    ('{"text": "a", "prompt": "b", "completion": "c"}', "both"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, bad, needle):
    p = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(T.DataError) as e:
        E.load_jsonl(p)
    msg = str(e.value)
    assert "d.jsonl" in msg and "line 3" in msg and needle in msg, msg


def test_jsonl_ok_and_empty_file(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"prompt": "", "completion": "x", "id": 7}])
    exs = E.load_jsonl(p)
    assert [e.line for e in exs] == [1, 2] and exs[1].completion == "x"
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(T.DataError, match="no examples"):
        E.load_jsonl(tmp_path / "e.jsonl")


def test_special_tokens_resolution(tok, tok_path, tmp_path):
    sp = T.special_tokens(tok)
    assert (sp.bos_id, sp.eos_id, sp.pad_id) == (1, 2, 0)
    sp = T.special_tokens(tok, bos=None, eos="</s>", pad=None)
    assert (sp.bos_id, sp.eos_id, sp.pad_id) == (None, 2, 2)
    with pytest.raises(T.DataError, match="not in the tokenizer"):
        T.special_tokens(tok, bos="<|begin_of_text|>")
    # tokenizer_config.json beside tokenizer.json wins over well-known names
    (tok_path.parent / "tokenizer_config.json").write_text(json.dumps({"bos_token": "a"}))
    try:
        assert T.special_tokens(tok, tokenizer_path=tok_path).bos_id == tok.token_to_id("a")
    finally:
        (tok_path.parent / "tokenizer_config.json").unlink()


def test_prompt_completion_masks_only_completion(tok):
    sp = T.special_tokens(tok)
    ex = E.parse_example({"prompt": "what? ", "completion": "hello."})
    ids, trained = TK.tokenize_example(tok, ex, sp)
    it = T.BatchIterator([(ids, trained)], seq_len=24, batch_size=1, packing=False, shuffle=False,
                         pad_id=sp.pad_id)
    b = next(it)
    m = b["loss_mask"][0].astype(bool)
    assert tok.decode([int(t) for t in b["targets"][0][m]], skip_special_tokens=False) \
        .replace(" ", "") == "hello.</s>"
    n = len(ids) - 1
    # inputs are the whole example minus its last token; nothing of the prompt is a target
    assert list(b["input_ids"][0][:n]) == list(ids[:-1])
    assert m.sum() == len("hello.") + 1 and not m[n:].any()
    assert not m[: 1 + len("what? ") - 1].any()  # targets that are prompt tokens
    # text examples: every token after BOS is a target
    ids, trained = TK.tokenize_example(tok, E.parse_example({"text": "abc"}), sp)
    assert list(trained) == [False, True, True, True, True]


def _check_rows(batch, seq_len):
    """segment ids 1..k then 0 padding; positions restart at each segment; targets are the next
    input inside a segment. Returns the segments as (inputs, targets) lists."""
    segs = []
    for r in range(batch["input_ids"].shape[0]):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        n = int(np.count_nonzero(seg))
        assert (seg[n:] == 0).all() and (pos[n:] == 0).all() and (batch["loss_mask"][r, n:] == 0).all()
        assert n > 0 and seg[0] == 1
        d = np.diff(seg[:n])
        assert set(np.unique(d)) <= {0, 1}
        for s in range(1, int(seg[:n].max()) + 1):
            idx = np.nonzero(seg == s)[0]
            assert (np.diff(idx) == 1).all()
            assert list(pos[idx]) == list(range(len(idx)))
            inp, tgt = batch["input_ids"][r, idx], batch["targets"][r, idx]
            assert (tgt[:-1] == inp[1:]).all()
            segs.append((tuple(inp), tuple(tgt)))
    return segs


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(2, 12), min_size=1, max_size=12),
       seq_len=st.integers(11, 16), batch_size=st.integers(1, 3), seed=st.integers(0, 5))
def test_packing_segments_positions_no_straddle(lengths, seq_len, batch_size, seed):
    # every example has distinct token values so that segments can be matched to examples
    docs, base = [], 0
    for n in lengths:
        docs.append(np.arange(base, base + n, dtype=np.int32))
        base += n
    tokenized = [(d, np.ones(len(d), bool)) for d in docs]
    it = T.BatchIterator(tokenized, seq_len=seq_len, batch_size=batch_size, packing=True,
                         seed=seed)
    want = {(tuple(d[:-1]), tuple(d[1:])) for d in docs}
    seen = []
    while len(seen) < len(docs):
        seen += _check_rows(next(it), seq_len)
    # each segment is one whole example (no document straddles a row or shares a segment),
    # and the first epoch holds each example exactly once
    first_epoch = seen[: len(docs)]
    assert sorted(first_epoch) == sorted(want)


def test_padding_mode_and_truncation(tok):
    sp = T.special_tokens(tok)
    docs = [E.parse_example({"text": t}) for t in ["ab", "abcdefghijklmnop", "xyz"]]
    tokd = TK.tokenize_examples(tok, docs, sp)
    it = T.BatchIterator(tokd, seq_len=8, batch_size=3, packing=False, shuffle=False,
                         pad_id=sp.pad_id)
    b = next(it)
    assert b["input_ids"].shape == (3, 8) and b["input_ids"].dtype == np.int32
    assert list(b["segment_ids"].max(axis=1)) == [1, 1, 1]
    assert list(np.count_nonzero(b["segment_ids"], axis=1)) == [3, 8, 4]  # 2+2-1, trunc, 3+2-1
    assert (b["input_ids"][0, 3:] == sp.pad_id).all() and (b["loss_mask"][0, 3:] == 0).all()
    _check_rows(b, 8)
    # overflow="split": the long example becomes several segments, each starting at position 0
    it = T.BatchIterator(tokd[1:2], seq_len=8, batch_size=3, packing=False, shuffle=False,
                         overflow="split")
    b = next(it)
    assert list(np.count_nonzero(b["segment_ids"], axis=1)) == [8, 8, 1]
    assert b["targets"][0, -1] == b["input_ids"][1, 0]


def test_iterator_resume_is_exact_across_epochs():
    rng = np.random.default_rng(0)
    tokd = [(rng.integers(0, 30, int(n)).astype(np.int32), np.ones(int(n), bool))
            for n in rng.integers(2, 9, 11)]
    kw = dict(seq_len=10, batch_size=2, packing=True, seed=7)
    a = T.BatchIterator(tokd, **kw)
    straight = [next(a) for _ in range(12)]
    b = T.BatchIterator(tokd, **kw)
    first = [next(b) for _ in range(5)]
    state = json.loads(json.dumps(b.state_dict()))
    c = T.BatchIterator(tokd, **kw)
    c.load_state_dict(state)
    rest = [next(c) for _ in range(7)]
    assert a.state_dict()["epoch"] >= 2
    for x, y in zip(straight, first + rest):
        for k in D.BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    # other data -> refused
    d = T.BatchIterator(tokd[:-1], **kw)
    with pytest.raises(T.DataError, match="different data"):
        d.load_state_dict(state)


def test_tokenizer_vocab_mismatch(tok, tmp_path, tok_path):
    TK.check_tokenizer_fits(tok, VOCAB)
    TK.check_tokenizer_fits(tok, VOCAB + 64)  # padded embeddings are fine
    with pytest.raises(T.DataError, match=r"vocab_size is 20"):
        TK.check_tokenizer_fits(tok, 20)
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(4))
    with pytest.raises(T.DataError, match="vocab_size"):
        T.train(StubLM(vocab_size=20), base_config(tmp_path, tok_path, data))


# ------------------------------------------------------------------------------------------------
# optimizer
# ------------------------------------------------------------------------------------------------

def test_schedule_warmup_then_cosine():
    s = T.make_schedule(1.0, 4, 14)
    vals = [float(s(i)) for i in range(16)]
    np.testing.assert_allclose(vals[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert vals[4] == pytest.approx(1.0) and vals[9] == pytest.approx(0.5, abs=1e-6)
    assert all(a >= b for a, b in zip(vals[4:], vals[5:])) and vals[14] == pytest.approx(0.0)
    tx = T.make_optimizer(1e-3, 0, 10, weight_decay=0.1, grad_clip=None)
    assert tx.init({"w": jnp.zeros(3)}) is not None


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------

def test_loss_decreases_and_only_lora_changes(tmp_path, tok_path):
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(32))
    model = StubLM(dropout=0.1)
    frozen_before = [np.asarray(x) for x in jax.tree.leaves(
        nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))]
    cfg = base_config(tmp_path, tok_path, data, steps=40, lr=3e-2, warmup=3, log_every=5,
                      eval_every=20, eval_data_path=str(data), progress=True)
    res = T.train(model, cfg)
    assert [s for s, _ in res.eval_losses] == [20, 40]
    assert res.eval_losses[-1][1] < res.eval_losses[0][1]
    with open(Path(cfg.out_dir) / "eval.csv") as f:
        assert [int(r[0]) for r in list(csv.reader(f))[1:]] == [20, 40]
    assert res.step == 40 and len(res.losses) == 40 and all(np.isfinite(res.losses))
    assert np.mean(res.losses[-5:]) < np.mean(res.losses[:3]) - 0.5, res.losses
    frozen_after = [np.asarray(x) for x in jax.tree.leaves(
        nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))]
    for a, b in zip(frozen_before, frozen_after):
        np.testing.assert_array_equal(a, b)
    # CSV: a row at step 1, then every 5 of 40, each loss the mean since the row before; PNG written
    with open(res.csv_path) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss", "lr", "tokens_per_s", "grad_norm"]
    assert [int(r[0]) for r in rows[1:]] == [1] + list(range(5, 41, 5))
    assert float(rows[1][1]) == pytest.approx(res.losses[0])
    assert float(rows[2][1]) == pytest.approx(np.mean(res.losses[1:5]))
    assert float(rows[-1][1]) == pytest.approx(np.mean(res.losses[35:]))
    assert [float(r[4]) for r in rows[2:]] == res.grad_norms[4::5]
    assert res.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # eval mode is restored to train mode afterwards, eval works
    ev = T.evaluate(model, T.make_batch_iterator(data, T.load_tokenizer(tok_path), seq_len=32,
                                                 batch_size=4).eval_batches())
    assert np.isfinite(ev) and ev < res.losses[0]
    # the out_dir now holds checkpoints: a non-resume run refuses to overwrite it
    with pytest.raises(FileExistsError, match="resume=True"):
        T.train(StubLM(), cfg)


def test_grad_accumulation_equals_big_batch(tmp_path, tok_path):
    # padding mode with uneven lengths: micro-batches hold different numbers of loss tokens
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(20, seed=1))
    out = {}
    for bs, k in [(4, 1), (2, 2)]:
        model = nf4_llama()
        cfg = base_config(tmp_path, tok_path, data, batch_size=bs, grad_accum=k, steps=3,
                          packing=False, out_dir=str(tmp_path / f"run{bs}"))
        res = T.train(model, cfg)
        out[k] = (res.losses, lora_arrays(model))
    np.testing.assert_allclose(out[1][0], out[2][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(out[1][1], out[2][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert max(np.abs(b).max() for b in out[1][1]) > 1e-3  # LoRA moved


class Crash(RuntimeError):
    pass


def test_resume_after_interruption_is_exact(tmp_path, tok_path):
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(10))  # several epochs in 6 steps
    N = 6
    # log_every 4: loss.csv's row at step 4 averages steps 2-4, across the resume after step 3
    kw = dict(steps=N, save_every=N // 2, log_every=4, seq_len=16, batch_size=2, grad_accum=2)

    straight = nf4_llama(dropout=0.2)
    ra = T.train(straight, base_config(tmp_path, tok_path, data, out_dir=str(tmp_path / "a"),
                                       **kw))

    def crash(step, metrics):
        if step == N // 2:
            raise Crash("simulated interruption")

    cfg_b = base_config(tmp_path, tok_path, data, out_dir=str(tmp_path / "b"), **kw)
    first = []
    with pytest.raises(Crash):
        T.train(nf4_llama(dropout=0.2), cfg_b,
                on_step=lambda s, m: (first.append(m["loss"]), crash(s, m)))
    resumed = nf4_llama(dropout=0.2)  # fresh objects, as in a new process
    rb = T.train(resumed, cfg_b, resume=True)
    assert rb.resumed_from == N // 2 and rb.steps == list(range(N // 2 + 1, N + 1))
    assert first + rb.losses == ra.losses  # bitwise: same batches, same dropout masks
    for a, b in zip(lora_arrays(straight), lora_arrays(resumed)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    with open(rb.csv_path) as f, open(ra.csv_path) as g:
        rows_b, rows_a = list(csv.reader(f))[1:], list(csv.reader(g))[1:]
    assert [int(r[0]) for r in rows_b] == [1, 4, 6]
    assert [r[1] for r in rows_b] == [r[1] for r in rows_a]  # each window's mean loss, bitwise
    # resuming a finished run is a no-op
    assert T.train(nf4_llama(dropout=0.2), cfg_b, resume=True).steps == []


class _RecordingStep:
    """Stands in for `loop.train_step`: records each dispatch and each read of a step's loss."""

    def __init__(self, real, events):
        self.real, self.events = real, events

    def bind(self, *objects):
        bound = self.real.bind(*objects)
        events = self.events

        class Read:
            def __init__(self, value, n, key):
                self.value, self.n, self.key = value, n, key

            def item(self):
                if self.key == "loss":
                    events.append(("read", self.n))
                return np.asarray(self.value).item()

        def step(batch):
            n = sum(1 for e in events if e[0] == "dispatch") + 1
            events.append(("dispatch", n))
            return {k: Read(v, n, k) for k, v in bound(batch).items()}

        return step


def test_host_reads_each_step_after_dispatching_the_next_except_at_boundaries(tmp_path, tok_path,
                                                                              monkeypatch):
    """Without on_step the host reads step N's metrics after dispatching step N + 1, so its own
    per-step work overlaps the device's; a checkpoint step and the last step are finished before
    anything else is dispatched. Losses, checkpoints and final LoRA params equal a run with an
    on_step callback, where every step is finished before the next."""
    from jqlora.train import loop as loop_mod

    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(16))
    kw = dict(steps=7, save_every=3, keep_checkpoints=None, batch_size=2)
    events = []
    monkeypatch.setattr(loop_mod, "train_step", _RecordingStep(loop_mod.train_step, events))
    piped = StubLM(dropout=0.1)
    rp = T.train(piped, base_config(tmp_path, tok_path, data, out_dir=str(tmp_path / "p"), **kw))
    d, r = "dispatch", "read"
    assert events == [(d, 1), (d, 2), (r, 1), (d, 3), (r, 2), (r, 3),  # step 3 saves a checkpoint
                      (d, 4), (d, 5), (r, 4), (d, 6), (r, 5), (r, 6), (d, 7), (r, 7)]
    events.clear()
    synced = StubLM(dropout=0.1)
    rs = T.train(synced, base_config(tmp_path, tok_path, data, out_dir=str(tmp_path / "s"), **kw),
                 on_step=lambda s, m: None)
    assert events == [e for n in range(1, 8) for e in ((d, n), (r, n))]
    assert rp.losses == rs.losses and rp.grad_norms == rs.grad_norms
    for a, b in zip(lora_arrays(piped), lora_arrays(synced)):
        np.testing.assert_array_equal(a, b)
    for name in ("step_00000003", "step_00000006", "step_00000007"):
        restored = []
        for run in ("p", "s"):
            m = StubLM(dropout=0.1)
            opt = nnx.Optimizer(m, T.make_optimizer(1e-2, 2, 7), wrt=nnx.LoRAParam)
            _, step = T.restore_checkpoint(tmp_path / run / "checkpoints" / name, m, opt)
            assert step == int(name[5:])
            restored.append(lora_arrays(m))
        for a, b in zip(*restored):
            np.testing.assert_array_equal(a, b)


class PoisonAt:
    """Wraps a BatchIterator; the n-th batch drawn (1-based) gets a NaN in its loss mask."""

    def __init__(self, it, n):
        self.it, self.n, self.count = it, n, 0

    def __next__(self):
        b = next(self.it)
        self.count += 1
        if self.count == self.n:
            b["loss_mask"][0, 0] = np.nan
        return b

    def state_dict(self):
        return self.it.state_dict()

    def load_state_dict(self, s):
        self.it.load_state_dict(s)


def test_nan_guard_names_step_and_keeps_checkpoint(tmp_path, tok_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(12))
    cfg = base_config(tmp_path, tok_path, data, steps=6, save_every=2)
    it = T.make_batch_iterator(data, tok, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=3)
    model = nf4_llama()
    seen = {}
    with pytest.raises(T.NonFiniteLossError, match=r"at step 3\b") as e, \
            pytest.warns(UserWarning, match="step_00000002 gave a non-finite loss at step 3"):
        T.train(model, cfg, data=PoisonAt(it, 3),
                on_step=lambda s, m: seen.__setitem__(s, lora_arrays(model)))
    # step 3's loss came from the step-2 checkpoint's weights: set aside, not resumed from
    assert e.value.step == 3 and e.value.checkpoint is None
    assert "the weights of step_00000002 gave it: moved to rejected_step_00000002" in str(e.value)
    ck = Path(cfg.out_dir) / "checkpoints"
    assert [p.name for p in sorted(ck.iterdir())] == ["rejected_step_00000002"]
    # the failed update was not applied in memory either
    for a, b in zip(seen[2], lora_arrays(model)):
        np.testing.assert_array_equal(a, b)
    # the checkpoint set aside is intact and restores to the step-2 params
    fresh = nf4_llama()
    opt = nnx.Optimizer(fresh, T.make_optimizer(1e-2, 2, 6), wrt=nnx.LoRAParam)
    _, step = T.restore_checkpoint(ck / "rejected_step_00000002", fresh, opt)
    assert step == 2
    for a, b in zip(seen[2], lora_arrays(fresh)):
        np.testing.assert_array_equal(a, b)
    # lr = inf: the first update produces non-finite params -> step 1
    cfg2 = base_config(tmp_path, tok_path, data, lr=float("inf"), out_dir=str(tmp_path / "inf"))
    with pytest.raises(T.NonFiniteLossError, match=r"at step 1\b"):
        T.train(nf4_llama(), cfg2)


@pytest.mark.parametrize("keep", [1, 2])
def test_nan_guard_with_save_every_1_keeps_a_checkpoint_that_resumes(tmp_path, tok_path, tok, keep):
    """save_every=1: the checkpoint of the step before a non-finite loss holds the weights that
    produced it; it is set aside, the error names the one before (still there with keep=1), and a
    resume from it (once the data is fixed) ends with the params of a run that never failed."""
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(12))
    kw = dict(steps=5, save_every=1, keep_checkpoints=keep, seq_len=16, batch_size=2)
    cfg = base_config(tmp_path, tok_path, data, **kw)
    it = T.make_batch_iterator(data, tok, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=3)
    with pytest.warns(UserWarning, match="step_00000003 gave a non-finite loss at step 4"):
        with pytest.raises(T.NonFiniteLossError, match=r"at step 4\b") as e:
            T.train(nf4_llama(), cfg, data=PoisonAt(it, 4))
    ck = Path(cfg.out_dir) / "checkpoints"
    assert e.value.checkpoint == ck / "step_00000002" and "step_00000002" in str(e.value)
    assert sorted(p.name for p in ck.iterdir()) == ["rejected_step_00000003", "step_00000002"]
    resumed = nf4_llama()
    res = T.train(resumed, cfg, resume=True)
    assert res.resumed_from == 2 and res.steps == [3, 4, 5]
    straight = nf4_llama()
    T.train(straight, base_config(tmp_path, tok_path, data, out_dir=str(tmp_path / "straight"), **kw))
    for a, b in zip(lora_arrays(straight), lora_arrays(resumed)):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(a).all() for a in lora_arrays(resumed))
    assert [p.name for p in sorted(ck.glob("step_*"))][-keep:][-1] == "step_00000005"


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------

def _model_opt(rank=4, dropout=0.1):
    m = StubLM(rank=rank, dropout=dropout)
    return m, nnx.Optimizer(m, T.make_optimizer(1e-2, 1, 10), wrt=nnx.LoRAParam)


def test_checkpoint_roundtrip_bf16_and_rng(tmp_path):
    m, opt = _model_opt()
    m.proj.lora.lora_a[...] = jnp.full(m.proj.lora.lora_a.shape, 0.3)
    m.drop(jnp.ones(4))  # advance the dropout counter
    path = T.save_checkpoint(tmp_path, m, opt, {"epoch": 1, "index": 2, "seed": 3}, 5)
    assert path.name == "step_00000005"
    raw = (path / "state.json").read_text()
    assert "pickle" not in raw and json.loads(raw)["step"] == 5
    m2, opt2 = _model_opt()
    ds, step = T.restore_checkpoint(tmp_path, m2, opt2)
    assert step == 5 and ds == {"epoch": 1, "index": 2, "seed": 3}
    for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.RngState)),
                    jax.tree.leaves(nnx.state(m2, nnx.RngState))):
        a, b = (jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                for x in (a, b))
        np.testing.assert_array_equal(a, b)
    for a, b in zip(lora_arrays(m), lora_arrays(m2)):
        np.testing.assert_array_equal(a, b)
    # bfloat16 LoRA params survive (stored as uint16 + dtype in the JSON)
    class BF(nnx.Module):
        def __init__(self):
            self.l = nnx.LoRA(4, 2, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    b1, b2 = BF(), BF()
    b2.l.lora_a[...] = jnp.zeros_like(b2.l.lora_a[...])
    T.save_checkpoint(tmp_path / "bf", b1, None, None, 1)
    T.restore_checkpoint(tmp_path / "bf", b2, None)
    assert b2.l.lora_a[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b1.l.lora_a[...], np.float32),
                                  np.asarray(b2.l.lora_a[...], np.float32))


def test_interrupted_checkpoint_write_keeps_previous(tmp_path, monkeypatch):
    m, opt = _model_opt()
    T.save_checkpoint(tmp_path, m, opt, {"epoch": 0, "index": 1, "seed": 0}, 1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_00000001").iterdir()}
    real = ckpt_mod.write_bytes_atomic
    calls = []

    def flaky(path, data):
        calls.append(path.name)
        if len(calls) == 2:  # arrays written, state.json fails midway
            Path(path).write_bytes(data[: len(data) // 2])
            raise OSError("disk full (simulated)")
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "write_bytes_atomic", flaky)
    m.proj.lora.lora_a[...] = m.proj.lora.lora_a[...] + 1
    with pytest.raises(OSError, match="disk full"):
        T.save_checkpoint(tmp_path, m, opt, {"epoch": 0, "index": 2, "seed": 0}, 2)
    calls.clear()
    with pytest.raises(OSError, match="disk full"):  # re-saving an existing step: old one kept
        T.save_checkpoint(tmp_path, m, opt, {"epoch": 0, "index": 2, "seed": 0}, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no temp litter
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_00000001").iterdir()} == before
    m2, opt2 = _model_opt()
    assert T.restore_checkpoint(tmp_path, m2, opt2) == ({"epoch": 0, "index": 1, "seed": 0}, 1)
    # keep=2 prunes older ones only after a successful write
    monkeypatch.setattr(ckpt_mod, "write_bytes_atomic", real)
    for s in (2, 3, 4):
        T.save_checkpoint(tmp_path, m, opt, None, s, keep=2)
    assert [s for s, _ in T.list_checkpoints(tmp_path)] == [3, 4]


def test_corrupt_or_mismatched_checkpoint_names_key(tmp_path):
    m, opt = _model_opt()
    path = T.save_checkpoint(tmp_path, m, opt, None, 1)
    # different LoRA rank -> shape mismatch naming the key
    m8, opt8 = _model_opt(rank=8)
    with pytest.raises(T.CheckpointError, match=r"'lora/proj\.lora\.lora_a' has shape \(32, 4\)"):
        T.restore_checkpoint(path, m8, opt8)
    # a model with an extra LoRA module -> missing key named
    class Two(StubLM):
        def __init__(self):
            super().__init__(dropout=0.1)
            self.extra = nnx.LoRA(4, 2, 4, rngs=nnx.Rngs(1))
    m2 = Two()
    before = lora_arrays(m2)
    with pytest.raises(T.CheckpointError, match=r"missing key 'lora/extra\.lora_a'"):
        T.restore_checkpoint(path, m2, nnx.Optimizer(m2, T.make_optimizer(1e-2, 1, 10),
                                                     wrt=nnx.LoRAParam))
    for a, b in zip(before, lora_arrays(m2)):  # nothing half-restored
        np.testing.assert_array_equal(a, b)
    # flipped bytes -> checksum error naming the file
    f = path / "arrays.safetensors"
    blob = bytearray(f.read_bytes())
    blob[-3] ^= 0xFF
    f.write_bytes(bytes(blob))
    with pytest.raises(T.CheckpointError, match="arrays.safetensors: checksum mismatch"):
        T.restore_checkpoint(path, *_model_opt())
    (path / "state.json").write_text("{not json")
    with pytest.raises(T.CheckpointError, match="state.json: corrupt"):
        T.restore_checkpoint(path, *_model_opt())
    with pytest.raises(FileNotFoundError):
        T.restore_checkpoint(tmp_path / "nothing", *_model_opt())


def test_checkpoint_arrays_file_is_standard_safetensors(tmp_path):
    """arrays.safetensors is what safetensors.numpy writes for the same tensors (byte for byte),
    and a file whose checksum matches but whose safetensors header is broken is refused by name."""
    import hashlib

    import safetensors.numpy as stn

    m, opt = _model_opt()
    path = T.save_checkpoint(tmp_path, m, opt, None, 1)
    f = path / ckpt_mod.ARRAYS_FILE
    arrays = stn.load_file(f)
    state = json.loads((path / ckpt_mod.STATE_FILE).read_text())
    assert set(arrays) == set(state["arrays"]) and any(k.startswith("lora/") for k in arrays)
    for k, meta in state["arrays"].items():
        assert list(arrays[k].shape) == meta["shape"], k
    assert f.read_bytes() == stn.save(arrays, metadata={"format": ckpt_mod.FORMAT})
    bad = b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a":{"dtype":"F32"}}'
    f.write_bytes(bad)
    state["arrays_sha256"] = hashlib.sha256(bad).hexdigest()
    (path / ckpt_mod.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(T.CheckpointError, match=r"corrupt safetensors file .*arrays\.safetensors"):
        T.restore_checkpoint(path, *_model_opt())


def test_remat_flag_uses_model_hook():
    class WithHook(StubLM):
        remat = False

        def set_remat(self, on):
            self.remat = on

    m = WithHook()
    loop._apply_remat(m, True)
    assert m.remat is True

    class WithAttr(StubLM):
        def __init__(self):
            super().__init__()
            self.remat = False

    m = WithAttr()
    loop._apply_remat(m, "dots")
    assert m.remat == "dots"
    with pytest.warns(UserWarning, match="no set_remat"):
        loop._apply_remat(StubLM(), True)


# ------------------------------------------------------------------------------------------------
# the compiled step keeps frozen weights out of its outputs
# ------------------------------------------------------------------------------------------------

def _quantized_llama_and_opt():
    from jqlora import lora, models
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    params = models.init_params(cfg, seed=0, std=0.1)
    m = models.from_params(params, cfg, quantize="nf4", compute_dtype=jnp.float32, remat=True,
                           lora=lora.LoraConfig(rank=4), rngs=nnx.Rngs(0))
    for _, layer in lora.named_linears(m):
        if layer.has_lora:
            layer.lora_B.set_value(jnp.full(layer.lora_B.shape, 0.01))
    return m, nnx.Optimizer(m, T.make_optimizer(1e-2, 1, 10), wrt=nnx.LoRAParam)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_train_step_is_one_documented_function():
    from jqlora.train import loop, step

    assert T.train_step is step.train_step is loop.train_step
    assert T.train_step.__name__ == "train_step"
    assert "Args:" in T.train_step.__doc__ and "Returns:" in T.train_step.__doc__


def test_train_step_outputs_exclude_frozen_weights_and_match_nnx_jit():
    from jqlora.lora.linear import FrozenParam
    from jqlora.train.step import _train_step_impl, train_step

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (1, 2, 17)).astype(np.int32)
    batch = {"input_ids": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": np.ones((1, 2, 16), np.float32),
             "segment_ids": np.ones((1, 2, 16), np.int32),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (1, 2, 16)).copy()}
    model, opt = _quantized_llama_and_opt()
    frozen = nnx.state((model, opt), FrozenParam)
    mutable = nnx.state((model, opt), nnx.Not(FrozenParam))
    assert _nbytes(frozen) > 3 * _nbytes(nnx.state(model, nnx.LoRAParam))  # the test means something
    lowered = train_step.lower(model, opt, batch)
    new_state_info, metrics_info = lowered.out_info
    # outputs: exactly the non-frozen state plus four scalars, not one frozen array
    assert _nbytes(lowered.out_info) == _nbytes(mutable) + _nbytes(metrics_info)
    assert _nbytes(new_state_info) == _nbytes(mutable)

    ref_model, ref_opt = _quantized_llama_and_opt()
    want = nnx.jit(_train_step_impl)(ref_model, ref_opt, batch)
    got = train_step(model, opt, batch)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)),
                    jax.tree.leaves(nnx.state(ref_model, nnx.LoRAParam))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # frozen weights are untouched and still usable (never donated)
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(nnx.state((model, opt), FrozenParam))):
        assert a is b and not a.is_deleted()
    # a second step reuses the compiled function and keeps training
    again = train_step(model, opt, batch)
    assert float(again["loss"]) < float(got["loss"])


def _tiny_batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, (1, 2, 17)).astype(np.int32)
    return {"input_ids": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": np.ones((1, 2, 16), np.float32),
            "segment_ids": np.ones((1, 2, 16), np.int32),
            "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (1, 2, 16)).copy()}


def test_bound_train_step_equals_unbound_and_updates_the_objects():
    """train_step.bind(model, opt) gives the same steps as train_step(model, opt, batch): same
    metrics, same LoRA params, optimizer state and RNG counts, written into the same objects."""
    from jqlora.lora.linear import FrozenParam
    from jqlora.train.step import train_step

    model, opt = _quantized_llama_and_opt()
    ref_model, ref_opt = _quantized_llama_and_opt()
    frozen_before = jax.tree.leaves(nnx.state((model, opt), FrozenParam))
    lora_vars = [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    bound = train_step.bind(model, opt)
    for seed in (0, 1, 2):
        batch = _tiny_batch(seed)
        got, want = bound(batch), train_step(ref_model, ref_opt, batch)
        for key in ("loss", "grad_norm", "ntokens", "ok"):
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
    # every non-frozen value (LoRA, optimizer moments and count, RNG counts) went into the objects
    got_state = nnx.to_flat_state(nnx.state((model, opt), nnx.Not(FrozenParam)))
    want_state = nnx.to_flat_state(nnx.state((ref_model, ref_opt), nnx.Not(FrozenParam)))
    assert [p for p, _ in got_state] == [p for p, _ in want_state]
    for (path, a), (_, b) in zip(got_state, want_state):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
    # the same Variable objects were updated (references taken before bind see the new values)
    now = [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    assert len(now) == len(lora_vars) and all(a is b for a, b in zip(now, lora_vars))
    # frozen weights: the same arrays, never donated
    for a, b in zip(frozen_before, jax.tree.leaves(nnx.state((model, opt), FrozenParam))):
        assert a is b and not a.is_deleted()


# xla: slow tier (the fused path's wiring is test_models.py::test_fused_attention_path_matches_einsum)
@pytest.mark.parametrize("attention", ["einsum", pytest.param("xla", marks=pytest.mark.slow)])
def test_unpacked_rows_need_no_segment_mask(attention):
    """train(packing=False) drops segment_ids: with one example per row from position 0 and the
    padding after it, plain causal attention gives the same loss, token count and LoRA gradients
    as the segment mask (the xla attention is the call that runs cuDNN on a GPU)."""
    from jqlora import lora, models
    from jqlora.train.step import _forward_sums

    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = models.from_params(models.init_params(cfg, seed=0, std=0.1), cfg, quantize="nf4",
                               compute_dtype=jnp.float32, lora=lora.LoraConfig(rank=4), rngs=nnx.Rngs(0),
                               attention=attention)
    for _, layer in lora.named_linears(model):
        if layer.has_lora:
            layer.lora_B.set_value(jnp.full(layer.lora_B.shape, 0.01))
    batch = {k: v[0] for k, v in _tiny_batch(3).items()}
    lengths = [16, 9]  # row 1: 9 real tokens, then padding (pad id 0, segment 0, no loss)
    for row, n in enumerate(lengths):
        batch["input_ids"][row, n:] = 0
        batch["loss_mask"][row, n:] = 0
        batch["segment_ids"][row, n:] = 0
        batch["positions"][row, n:] = 0
    unpacked = {k: v for k, v in batch.items() if k != "segment_ids"}

    @nnx.jit  # one compile per batch layout instead of one per eagerly dispatched op
    def forward_and_grads(m, b):
        return nnx.value_and_grad(lambda m_: _forward_sums(m_, b), has_aux=True,
                                  argnums=nnx.DiffState(0, nnx.LoRAParam))(m)

    def sums_and_grads(b):
        (s, n), g = forward_and_grads(model, {k: jnp.asarray(v) for k, v in b.items()})
        return float(s), float(n), jax.tree.leaves(g)

    s_mask, n_mask, g_mask = sums_and_grads(batch)
    s_plain, n_plain, g_plain = sums_and_grads(unpacked)
    assert n_plain == n_mask == 16 + 9
    np.testing.assert_allclose(s_plain, s_mask, rtol=1e-6)
    for a, b in zip(g_plain, g_mask):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    # the mask does matter once a row holds two examples: the check above can fail
    packed = dict(batch, segment_ids=np.where(np.arange(16) < 8, 1, 2)[None].repeat(2, 0).astype(np.int32))
    assert abs(sums_and_grads(packed)[0] - s_plain) > 1e-3


def test_bound_step_reads_values_set_between_calls_and_checks_its_arguments():
    from jqlora import lora
    from jqlora.train.frozen import frozen_jit

    model, _ = _quantized_llama_and_opt()
    ids = jnp.asarray(_tiny_batch()["input_ids"][0])
    logits = frozen_jit(lambda m, x: m(x)).bind(model)
    before = np.asarray(logits(ids))
    name, layer = next((n, l) for n, l in lora.named_linears(model) if l.has_lora)
    layer.lora_B.set_value(layer.lora_B[...] * 3.0)  # a trainable value changed outside the step
    assert not np.allclose(np.asarray(logits(ids)), before), name
    np.testing.assert_allclose(np.asarray(logits(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="exactly 1 NNX objects"):
        frozen_jit(lambda m, x: m(x)).bind(model, model)

    def grows(m, x):  # changes the structure of the non-frozen state inside the step
        m.extra = nnx.Param(jnp.zeros(()))
        return m(x)

    with pytest.raises(ValueError, match="changed the structure"):
        frozen_jit(grows).bind(model)(ids)


@settings(max_examples=5, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 40), chunk=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_chunked_cross_entropy_equals_full_on_random_shapes(b, t, chunk, seed):
    """The lax.scan over padded chunks gives the full-logits loss sum, token count and gradient
    for any sequence length and chunk size (last chunk partial or not, t <= chunk)."""
    from jqlora.train.step import chunked_cross_entropy, masked_cross_entropy

    rng = np.random.default_rng(seed)
    d, v = 8, 11
    w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(rng.random((b, t)) < 0.7, jnp.float32)
    lm = lambda x: x @ w  # noqa: E731

    def full(h_):
        return masked_cross_entropy(lm(h_), targets, mask)

    def chunked(h_):
        return chunked_cross_entropy(lm, h_, targets, mask, chunk)

    # each side and its gradient jitted whole: one compile per example instead of one per
    # eagerly dispatched op of the scan and its transpose
    (s_f, n_f), g_f = jax.jit(lambda x: (full(x), jax.grad(lambda y: full(y)[0])(x)))(h)
    (s_c, n_c), g_c = jax.jit(lambda x: (chunked(x), jax.grad(lambda y: chunked(y)[0])(x)))(h)
    assert float(n_c) == float(n_f) == float(mask.sum())
    np.testing.assert_allclose(float(s_c), float(s_f), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_c), np.asarray(g_f), rtol=1e-5, atol=1e-6)
