"""jqlora.train.adamw8bit: bitsandbytes' dynamic maps and blockwise quantization, the 8-bit Adam
step against bitsandbytes' own `AdamW8bit` on CPU and against `optax.adamw`, its state's size,
training and checkpoints with it, and `jqlora train --optimizer adamw8bit`."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jqlora import train as T
from jqlora.train import adamw8bit as A8
from jqlora.train.optim import make_optimizer

SHAPES = [(3, 64, 96), (37, 111), (2, 40, 130)]  # per matrix: 24 blocks; 16.04 and 20.3 blocks (padded)


def _sample(shape, signed: bool, seed: int = 0) -> np.ndarray:
    """Values over several decades (as Adam's moments are), a block of zeros, a zero in a nonzero
    block; squared (non-negative) for the unsigned map."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 0, shape)
    flat = x.reshape(-1, shape[-2] * shape[-1])
    flat[0, :256] = 0.0   # a whole block of zeros: absmax 0, codes 0
    flat[-1, 300] = 0.0   # a zero among nonzero values
    x = flat.reshape(shape).astype(np.float32)
    return x if signed else (x * x).astype(np.float32)


def _nearest_reference(x: np.ndarray, code: np.ndarray, block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per matrix (last two axes), blocks of ``block``: absmax, then the index of the nearest code
    entry to ``x * float32(1 / absmax)`` by float64 distance (numpy's argmin: the lower index on a
    tie). All-zero blocks: code 0. Returns (codes shaped as x, absmax (..., 1, n_blocks))."""
    lead, n = x.shape[:-2], x.shape[-2] * x.shape[-1]
    nb = -(-n // block)
    flat = np.zeros((*lead, nb * block), np.float32)
    flat[..., :n] = x.reshape(*lead, n)
    blocks = flat.reshape(*lead, nb, block)
    absmax = np.abs(blocks).max(-1)
    inv = (np.float32(1.0) / np.where(absmax > 0, absmax, np.float32(1.0))).astype(np.float32)
    scaled = (blocks * inv[..., None]).astype(np.float32).astype(np.float64)
    idx = np.abs(scaled[..., None] - code.astype(np.float64)).argmin(-1)
    idx = np.where((absmax > 0)[..., None], idx, 0)
    codes = idx.reshape(*lead, nb * block)[..., :n].reshape(x.shape).astype(np.uint8)
    return codes, absmax[..., None, :].astype(np.float32)


def _q(x, code):
    codes, absmax = A8.quantize_blockwise(jnp.asarray(x), code)
    return np.asarray(codes), np.asarray(absmax)


# ------------------------------------------------------------------------------------------------
# the maps and the quantizer
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_map_entries(shape, signed):
    code = A8.SIGNED_MAP if signed else A8.UNSIGNED_MAP
    x = _sample(shape, signed, seed=len(shape))
    codes, absmax = _q(x, code)
    ref_codes, ref_absmax = _nearest_reference(x, code)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    assert absmax.shape == (*shape[:-2], 1, -(-shape[-2] * shape[-1] // 256))
    np.testing.assert_array_equal(absmax, ref_absmax)
    np.testing.assert_array_equal(codes, ref_codes)
    # dequantized: each value within half the gap around its entry, times its block's absmax
    back = np.asarray(A8.dequantize_blockwise(jnp.asarray(codes), jnp.asarray(absmax), code))
    gaps = np.diff(code).max()
    scale = np.repeat(absmax, 256, axis=-1).reshape(*shape[:-2], -1)[..., :shape[-2] * shape[-1]].reshape(shape)
    assert np.all(np.abs(back - x) <= 0.5 * gaps * scale * 1.0001)  # -1 lies half a gap below code[0]
    assert np.all(back.reshape(-1, shape[-2] * shape[-1])[0, :256] == 0)  # the zero block


@pytest.mark.torch
def test_maps_are_bitsandbytes_dynamic_maps():
    F = pytest.importorskip("bitsandbytes.functional")
    for signed, ours in ((True, A8.SIGNED_MAP), (False, A8.UNSIGNED_MAP)):
        theirs = F.create_dynamic_map(signed=signed).numpy()
        assert ours.dtype == np.float32 and ours.shape == (256,)
        np.testing.assert_array_equal(ours, theirs)
    # what the 8-bit blockwise optimizers pick: name2qmap["dynamic"] / ["udynamic"]
    import torch

    bnb = pytest.importorskip("bitsandbytes")
    opt = bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))])
    opt.fill_qmap()
    np.testing.assert_array_equal(opt.name2qmap["dynamic"].numpy(), A8.SIGNED_MAP)
    np.testing.assert_array_equal(opt.name2qmap["udynamic"].numpy(), A8.UNSIGNED_MAP)


def _lut_moves(x: np.ndarray, absmax: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Where bitsandbytes' CPU quantizer (0.50) picks another entry than the nearest one. It rounds
    each scaled value to one of 65,536 bins over [-1, 1] (bin k centred on -1 + 2k / 65535) and
    takes the entry nearest the bin's centre: a value near a midpoint, and any value within half a
    bin of zero, may land on the far side. Computed in float32 as its kernel does, with and without
    a fused multiply-add (flagged if either moves the value). Per matrix."""
    f32 = np.float32
    lead, n = x.shape[:-2], x.shape[-2] * x.shape[-1]
    scale = np.repeat(absmax, 256, axis=-1).reshape(*lead, -1)[..., :n]
    inv = (f32(1) / np.where(scale > 0, scale, f32(1))).astype(f32)
    s = np.clip((x.reshape(*lead, n) * inv).astype(f32), f32(-1), f32(1))
    mid = (f32(0.5) * (code[:-1] + code[1:])).astype(f32)
    own = np.searchsorted(mid, s, side="left")
    centres = (f32(-1) + (f32(2) * np.arange(65536, dtype=f32)) / f32(65535)).astype(f32)
    table = np.searchsorted(mid, centres, side="left")
    half = ((s + f32(1)).astype(f32) * f32(0.5)).astype(f32)
    k_rounded = ((half * f32(65535)).astype(f32) + f32(0.5)).astype(f32).astype(np.int64)
    k_fused = (half.astype(np.float64) * 65535 + 0.5).astype(f32).astype(np.int64)
    moved = (table[k_rounded] != own) | (table[k_fused] != own)
    return (moved & (scale > 0)).reshape(x.shape)


@pytest.mark.torch
@pytest.mark.parametrize("signed", [True, False])
def test_codes_match_bitsandbytes_quantize_blockwise_on_cpu(signed):
    """Per matrix, against `bitsandbytes.functional.quantize_blockwise(code=, blocksize=256)` on CPU:
    absmax bit-identical; codes bit-identical except where bitsandbytes' CPU lookup table moves a
    value off its nearest entry (_lut_moves: 0.1% of normal values for the signed map, 3% of
    squared ones for the unsigned, and the zeros in nonzero blocks); dequantizing equal codes gives
    bit-identical values."""
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    code = A8.SIGNED_MAP if signed else A8.UNSIGNED_MAP
    tcode = torch.from_numpy(code.copy())
    rng = np.random.default_rng(7)
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(np.float32)
        x.reshape(-1)[:256] = 0.0  # a block of zeros
        x.reshape(-1)[300] = 0.0   # a zero among nonzero values
        x = x if signed else x * x
        codes, absmax = _q(x, code)
        mats = x.reshape(-1, shape[-2] * shape[-1])
        theirs = [F.quantize_blockwise(torch.from_numpy(m.copy()), code=tcode, blocksize=256) for m in mats]
        their_codes = np.stack([q.numpy() for q, _ in theirs]).reshape(shape)
        their_absmax = np.stack([s.absmax.numpy() for _, s in theirs]).reshape(absmax.shape)
        np.testing.assert_array_equal(absmax, their_absmax)
        same = ~_lut_moves(x, absmax, code)
        np.testing.assert_array_equal(codes[same], their_codes[same])
        assert same.mean() > (0.99 if signed else 0.95), (shape, same.mean())
        their_back = np.stack([F.dequantize_blockwise(torch.from_numpy(q.numpy().copy()), s).numpy()
                               for q, s in theirs]).reshape(shape)
        ours_back = np.asarray(A8.dequantize_blockwise(jnp.asarray(their_codes), jnp.asarray(absmax), code))
        np.testing.assert_array_equal(ours_back, their_back)


# ------------------------------------------------------------------------------------------------
# the optimizer
# ------------------------------------------------------------------------------------------------

LR, WD = 1e-3, 0.01


def _jq_steps(p0: dict, grads: list[dict], optimizer: str, *, jit: bool = True):
    """``make_optimizer`` (constant lr, no clip) applied to ``p0`` for each gradient; -> (params, state).
    ``jit=False``: op by op, so that two optimizers' equal operations give equal bits (compiled,
    XLA fuses each program its own way, and may contract a * b + c differently)."""
    tx = make_optimizer(LR, 0, 1000, weight_decay=WD, grad_clip=None, lr_schedule="constant", optimizer=optimizer)

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step

    params = jax.tree.map(jnp.asarray, p0)
    state = tx.init(params)
    for g in grads:
        params, state = step(params, state, jax.tree.map(jnp.asarray, g))
    return jax.tree.map(np.asarray, params), state


def _problem(shape, steps, seed=0):
    rng = np.random.default_rng(seed)
    p0 = (0.02 * rng.standard_normal(shape)).astype(np.float32)  # LoRA-sized weights: ulp ~ 4e-9
    rows = rng.uniform(0.05, 3.0, size=(*shape[:-1], 1))        # rows of different scales, as in a LoRA
    grads = [(rng.standard_normal(shape) * rows).astype(np.float32) for _ in range(steps)]
    return p0, grads


def _adam8(state):
    """The ScaleByAdam8bitState inside make_optimizer(grad_clip=None)'s chain."""
    return state[0][0]


@pytest.mark.torch
def test_matches_bitsandbytes_adamw8bit_on_cpu(monkeypatch):
    """5 steps of bitsandbytes' `AdamW8bit` (CPU; lr 1e-3, weight decay 0.01) and of jqlora's on one
    (64, 130) parameter (8,320 elements: 32.5 blocks) with the same gradients.

    bitsandbytes' CPU requantization rounds through its lookup table (test above); with it replaced
    by the nearest-entry reference (the rounding of its CUDA kernels) the runs hold the same codes
    but for a rare moment that lies within float32 rounding of a midpoint (torch and XLA order
    their float32 operations differently), and the parameters agree to 1e-7 (a few float32 ulps of
    weights of 0.02 scale) but for those, against steps that move them 5e-3. With its own table,
    the elements whose moments the table moved (8% here) differ by up to 10% of the movement."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    cpu_ops = pytest.importorskip("bitsandbytes.backends.cpu.ops")
    if not hasattr(cpu_ops, "_quant_blockwise_fp32_direct"):
        pytest.skip("this bitsandbytes has no CPU 8-bit blockwise optimizer step")
    p0, grads = _problem((64, 130), 5)

    def bnb_run():
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = bnb.optim.AdamW8bit([p], lr=LR, weight_decay=WD)
        for g in grads:
            p.grad = torch.from_numpy(g.copy())
            opt.step()
        return p.detach().numpy().copy(), opt.state[p]

    def nearest(values, code, absmax_out, codes_out, blocksize):
        c, a = _nearest_reference(values.numpy().reshape(1, -1), code.numpy(), blocksize)
        codes_out.copy_(torch.from_numpy(c.reshape(codes_out.shape)))
        absmax_out.copy_(torch.from_numpy(a.reshape(-1)))

    with_table, _ = bnb_run()
    monkeypatch.setattr(cpu_ops, "_quant_blockwise_fp32_direct", nearest)
    theirs, their_state = bnb_run()
    ours, state = _jq_steps({"w": p0}, [{"w": g} for g in grads], "adamw8bit")
    ours, st = ours["w"], _adam8(state)
    moved = np.abs(ours - p0).max()
    assert 4e-3 < moved < 6e-3, moved
    diff = np.abs(ours - theirs)
    assert (diff <= 1e-7).mean() > 0.999 and diff.max() < 0.01 * moved, ((diff > 1e-7).sum(), diff.max())
    for mine, key in ((st.mu, "state1"), (st.nu, "state2")):
        assert (np.asarray(mine["w"]) == their_state[key].numpy()).mean() > 0.999
    for mine, key in ((st.mu_absmax, "absmax1"), (st.nu_absmax, "absmax2")):
        np.testing.assert_allclose(np.asarray(mine["w"]).ravel(), their_state[key].numpy(), rtol=1e-5)
    # bitsandbytes with its own CPU table
    diff = np.abs(ours - with_table)
    assert (diff <= 1e-7).mean() > 0.85 and diff.max() < 0.25 * moved, ((diff > 1e-7).mean(), diff.max())


def _numpy_adamw8bit(p0, grads, b1=0.9, b2=0.999, eps=1e-8):
    """The algorithm in float64 numpy: the moments requantized (nearest entry, float64) after
    every step, the update from the float64 moments of that step."""
    p = p0.astype(np.float64)
    m_codes, m_absmax = np.zeros(p.shape, np.uint8), np.zeros((1, -(-p.size // 256)))
    v_codes, v_absmax = m_codes.copy(), m_absmax.copy()

    def deq(codes, absmax, code):
        vals = np.zeros(absmax.shape[-1] * 256)
        vals[:p.size] = code.astype(np.float64)[codes.reshape(-1)]
        return (vals.reshape(-1, 256) * absmax.reshape(-1, 1)).reshape(-1)[:p.size].reshape(p.shape)

    def quant(x, code):
        flat = np.zeros(m_absmax.shape[-1] * 256)
        flat[:p.size] = x.reshape(-1)
        blocks = flat.reshape(-1, 256)
        absmax = np.abs(blocks).max(-1)
        scaled = blocks / np.where(absmax > 0, absmax, 1)[:, None]
        idx = np.abs(scaled[..., None] - code.astype(np.float64)).argmin(-1)
        return idx.reshape(-1)[:p.size].reshape(p.shape).astype(np.uint8), absmax[None]

    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        m = b1 * deq(m_codes, m_absmax, A8.SIGNED_MAP) + (1 - b1) * g
        v = b2 * deq(v_codes, v_absmax, A8.UNSIGNED_MAP) + (1 - b2) * g * g
        update = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        p = p - LR * (update + WD * p)
        m_codes, m_absmax = quant(m, A8.SIGNED_MAP)
        v_codes, v_absmax = quant(v, A8.UNSIGNED_MAP)
    return p


def test_tracks_a_float64_reference_and_float32_adamw():
    """20 steps on a (64, 96) parameter: within 1e-6 of the float64 numpy algorithm (2.5e-7 here,
    against a movement of 1.5e-2), and close to float32 AdamW, the moments' rounding being the only
    difference: on average 2% of the movement here (bounded at 5%), at most 6% (bounded at 10%)."""
    p0, grads = _problem((64, 96), 20, seed=1)
    ours, _ = _jq_steps({"w": p0}, [{"w": g} for g in grads], "adamw8bit")
    ref = _numpy_adamw8bit(p0, grads)
    np.testing.assert_allclose(ours["w"], ref, rtol=0, atol=1e-6)
    full, _ = _jq_steps({"w": p0}, [{"w": g} for g in grads], "adamw")
    moved, gap = np.abs(full["w"] - p0), np.abs(ours["w"] - full["w"])
    assert gap.mean() < 0.05 * moved.mean() and gap.max() < 0.1 * moved.max(), (gap.mean(), gap.max())
    assert gap.max() > 1e-5  # 8-bit moments: close to AdamW, not equal


def test_small_leaves_take_optax_adamw_updates():
    """Leaves under 4096 elements, and 1-D leaves of any size, keep float32 moments and take
    optax.scale_by_adam's own step: with no quantized leaf beside them, op by op, bit for bit what
    optax.adamw gives; beside one, to float32 rounding (optax's bias correction runs as one XLA
    computation over the whole tree, whose simplification depends on what it holds). A (64, 64)
    leaf (4096 elements) is quantized."""
    rng = np.random.default_rng(3)
    shapes = {"small": (8, 16), "almost": (63, 65), "vector": (5000,), "big": (64, 64)}
    p0 = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(6)]
    small = [k for k in shapes if k != "big"]
    only = ({k: p0[k] for k in small}, [{k: g[k] for k in small} for g in grads])
    ours, state = _jq_steps(*only, "adamw8bit", jit=False)
    theirs, _ = _jq_steps(*only, "adamw", jit=False)
    for k in small:
        np.testing.assert_array_equal(ours[k], theirs[k])
    assert all(_adam8(state).mu_absmax[k] is None for k in small)
    ours, state = _jq_steps(p0, grads, "adamw8bit")
    theirs, _ = _jq_steps(p0, grads, "adamw")
    for k in small:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, atol=1e-9)
    st = _adam8(state)
    assert {k for k in shapes if st.mu_absmax[k] is not None} == {"big"}
    assert st.mu["big"].dtype == jnp.uint8 and st.mu["small"].dtype == jnp.float32
    assert np.abs(ours["big"] - theirs["big"]).max() > 1e-6  # 8-bit moments: not AdamW's exact steps


def test_state_of_a_4096_by_16_leaf_takes_two_bytes_an_element():
    params = {"w": jnp.zeros((4096, 16), jnp.float32)}
    state = make_optimizer(1e-3, 0, 10, grad_clip=None, optimizer="adamw8bit").init(params)
    st = _adam8(state)
    moments = sum(x.nbytes for x in jax.tree.leaves((st.mu, st.nu)))
    absmax = sum(x.nbytes for x in jax.tree.leaves((st.mu_absmax, st.nu_absmax)))
    assert moments == 2 * 4096 * 16 and absmax == 2 * 4 * (4096 * 16 // 256)
    assert st.mu_absmax["w"].shape == (1, 256)
    full = make_optimizer(1e-3, 0, 10, grad_clip=None).init(params)
    assert sum(x.nbytes for x in jax.tree.leaves(full)) - 8 == 8 * 4096 * 16  # less the two counts
    # an expert stack (E, a, b): absmax per matrix, the same ndim as the parameter
    stack = make_optimizer(1e-3, 0, 10, optimizer="adamw8bit").init({"e": jnp.zeros((4, 128, 40))})
    assert stack[1][0].nu_absmax["e"].shape == (4, 1, 20) and stack[1][0].nu["e"].shape == (4, 128, 40)


def test_a_large_stacked_leaf_goes_in_slices_with_the_same_result(monkeypatch):
    """Above CHUNK elements a leaf of 3+ dims is requantized in slices of its first axis (lax.map,
    the last batch shorter here): updates and state equal those of the whole leaf at once."""
    rng = np.random.default_rng(5)
    p0 = {"w": (0.02 * rng.standard_normal((7, 64, 96))).astype(np.float32)}
    grads = [{"w": rng.standard_normal((7, 64, 96)).astype(np.float32)} for _ in range(3)]

    def run():
        tx = A8.scale_by_adam_8bit()
        step = jax.jit(tx.update)
        state, out = tx.init(p0), []
        for g in grads:
            u, state = step(g, state)
            out.append(u)
        return out, state

    whole, whole_state = run()
    monkeypatch.setattr(A8, "CHUNK", 2 * 64 * 96)  # batches of 2 slices: 2, 2, 2, 1
    sliced, sliced_state = run()
    for a, b in zip(jax.tree.leaves((whole, whole_state)), jax.tree.leaves((sliced, sliced_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sliced_state.nu["w"].dtype == jnp.uint8 and sliced_state.nu_absmax["w"].shape == (7, 1, 24)


def test_expert_stacks_state_is_cut_by_expert_on_a_mesh(capsys):
    """`moe_bench --mesh fsdp=2 --optimizer adamw8bit` on the suite's 2 host devices: the step runs
    and the line says the optimizer; `place_state` cuts the 8-bit codes and the absmax of the
    expert LoRA stacks (layers, experts, a, b) by expert, as it cuts the factors."""
    from benchmarks import moe_bench
    from jqlora import lora, models, parallel

    if len(jax.devices()) < 2:
        pytest.skip("needs the suite's 2 forced host devices")
    moe_bench.main(["--side", "jax", "--tiny", "--layers", "1", "--seq", "16", "--steps", "1", "--mesh", "fsdp=2",
                    "--optimizer", "adamw8bit"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["optimizer"] == "adamw8bit" and row["devices"] == 2 and np.isfinite(row["loss"])
    c = moe_bench.config(tiny=True, layers=1)
    model = models.from_params(moe_bench._params_jax(c), c, compute_dtype=jnp.float32,
                               lora=lora.LoraConfig(rank=16, alpha=32, target_modules="all-linear"))
    opt = nnx.Optimizer(model, make_optimizer(1e-4, 2, 10, optimizer="adamw8bit"), wrt=nnx.LoRAParam)
    parallel.place_state(model, opt, parallel.resolve_mesh("fsdp=2"))
    experts = {}
    for path, var in nnx.to_flat_state(nnx.state(opt)):
        if "experts" in path and var.get_value() is not None:
            experts[".".join(map(str, path[3:4] + path[-2:]))] = var.get_value()
    assert {k for k, v in experts.items() if v.dtype == jnp.uint8} == {
        f"{m}.{w}.{f}" for m in ("mu", "nu") for w in ("down_proj", "gate_up_proj") for f in ("lora_A", "lora_B")}
    for key, value in experts.items():
        assert value.ndim == 4 and value.sharding.spec[1] == "fsdp", (key, value.shape, value.sharding.spec)
        assert value.addressable_shards[0].data.shape[1] == value.shape[1] // 2


def test_optimizer_name_is_checked():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; expected one of adamw, adamw8bit"):
        make_optimizer(1e-3, 0, 10, optimizer="sgd")
    with pytest.raises(ValueError, match="TrainConfig.optimizer must be one of adamw, adamw8bit, got 'adam8'"):
        T.TrainConfig(optimizer="adam8").validate()
    assert make_optimizer(1e-3, 0, 10, optimizer="adamw8bit") is make_optimizer(1e-3, 0, 10, optimizer="adamw8bit")
    assert make_optimizer(1e-3, 0, 10, optimizer="adamw8bit") is not make_optimizer(1e-3, 0, 10)


# ------------------------------------------------------------------------------------------------
# training and checkpoints (the tiny model of tests/train/test_train.py, wide enough for 8-bit leaves)
# ------------------------------------------------------------------------------------------------

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?"
SPECIALS = ["<pad>", "<s>", "</s>"]
VOCAB = len(SPECIALS) + len(ALPHABET) + 1


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(ALPHABET) + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class StubConfig:
    vocab_size: int


class WideStubLM(nnx.Module):
    """embedding (+ previous token) -> LoRALinear (dim 1024, rank 4: both factors 4096 elements,
    8-bit moments) -> head; a second, narrow LoRALinear keeps float32 moments."""

    def __init__(self, dim=1024, seed=0):
        rngs = nnx.Rngs(params=seed, dropout=seed + 100)
        self.config = StubConfig(VOCAB)
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.prev = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.proj = nnx.LoRALinear(dim, dim, lora_rank=4, rngs=rngs)
        self.narrow = nnx.LoRALinear(dim, 8, lora_rank=2, rngs=rngs)
        self.head = nnx.Linear(dim, VOCAB, rngs=rngs)

    def __call__(self, input_ids, *, positions=None, segment_ids=None, cache=None):
        if segment_ids is None:
            segment_ids = jnp.ones_like(input_ids)
        prev_ids = jnp.pad(input_ids, ((0, 0), (1, 0)))[:, :-1]
        prev_seg = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
        same = ((prev_seg == segment_ids) & (segment_ids > 0))[..., None]
        h = self.embed(input_ids) + jnp.where(same, self.prev(prev_ids), 0.0)
        h = h + jnp.tanh(self.proj(h))
        return self.head(h.at[..., :8].add(self.narrow(h)))


def _rows(n=32, seed=0):
    rng = np.random.default_rng(seed)
    words = ["abc", "hello", "the cat", "xyz", "go, go!"]
    return [{"text": " ".join([words[i % len(words)]] * int(rng.integers(1, 4)))} for i in range(n)]


def test_trains_a_tiny_model(tmp_path, tok_path):
    """`train()` with TrainConfig(optimizer="adamw8bit"): the loss drops, and its checkpoint holds
    uint8 moments for the wide LoRA factors, float32 ones (and no absmax) for the narrow."""
    from jqlora.train.checkpoint import read_state

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cfg = T.TrainConfig(data_path=str(data), tokenizer_path=str(tok_path), seq_len=32, batch_size=4, lr=3e-2,
                        warmup=2, steps=25, seed=3, out_dir=str(tmp_path / "run"), save_every=0, log_every=5,
                        progress=False, tensorboard=False, optimizer="adamw8bit")
    res = T.train(WideStubLM(), cfg)
    assert res.step == 25 and all(np.isfinite(res.losses))
    assert np.mean(res.losses[-5:]) < np.mean(res.losses[:3]) - 0.5, res.losses
    state = read_state(res.checkpoint)
    dtypes = {k: m["dtype"] for k, m in state["arrays"].items() if k.startswith("opt/")}
    assert dtypes["opt/opt_state.1.0.mu.proj.lora.lora_a"] == "uint8"
    assert dtypes["opt/opt_state.1.0.nu_absmax.proj.lora.lora_b"] == "float32"
    assert dtypes["opt/opt_state.1.0.mu.narrow.lora.lora_b"] == "float32"
    assert not any("absmax.narrow" in k for k in dtypes)  # float32 leaves have no absmax
    assert state["extra"]["train_config"]["optimizer"] == "adamw8bit"


def _model_and_opt(seed=0):
    m = WideStubLM(seed=seed)
    return m, nnx.Optimizer(m, make_optimizer(1e-2, 1, 10, optimizer="adamw8bit"), wrt=nnx.LoRAParam)


def test_checkpoint_round_trip_keeps_uint8_moments(tmp_path):
    m, opt = _model_and_opt()
    for i in range(3):
        grads = nnx.state(m, nnx.LoRAParam)
        grads = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.key(i), x.shape, x.dtype), grads)
        opt.update(m, grads)
    T.save_checkpoint(tmp_path, m, opt, {"epoch": 0, "index": 3, "seed": 0}, 3)
    m2, opt2 = _model_and_opt(seed=1)
    _, step = T.restore_checkpoint(tmp_path, m2, opt2)
    assert step == 3
    want = dict(nnx.to_flat_state(nnx.state(opt)))
    got = nnx.to_flat_state(nnx.state(opt2))
    assert len(got) == len(want)
    n_uint8 = 0
    for path, var in got:
        a, b = var.get_value(), want[path].get_value()
        if b is None:  # the absmax of a float32 leaf
            assert a is None, path
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        n_uint8 += a.dtype == jnp.uint8
    assert n_uint8 == 4  # mu and nu of proj's two factors
    assert np.asarray(opt2.opt_state[1][0].mu["proj"]["lora"]["lora_a"][...]).any()
    for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.LoRAParam)), jax.tree.leaves(nnx.state(m2, nnx.LoRAParam))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the next step continues identically from the restored state
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.1, x.dtype), nnx.state(m, nnx.LoRAParam))
    opt.update(m, grads)
    opt2.update(m2, grads)
    for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.LoRAParam)), jax.tree.leaves(nnx.state(m2, nnx.LoRAParam))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # an AdamW optimizer cannot take this checkpoint
    m3 = WideStubLM()
    with pytest.raises(T.CheckpointError, match="different model/LoRA/optimizer setup"):
        T.restore_checkpoint(tmp_path, m3, nnx.Optimizer(m3, make_optimizer(1e-2, 1, 10), wrt=nnx.LoRAParam))


# ------------------------------------------------------------------------------------------------
# jqlora train --optimizer adamw8bit
# ------------------------------------------------------------------------------------------------

@pytest.mark.torch
def test_cli_trains_with_adamw8bit_and_refuses_another_optimizer_on_resume(tmp_path_factory, tmp_path, capsys):
    """One 2-step run on the tiny NF4 Llama (2 layers, hidden 64, MLP 128; rank 16 on q_proj and
    down_proj: down_proj's A, stacked over the layers, is (2, 128, 16), 4096 elements, 8-bit; the
    other factors 2048, float32), then `--resume` with `--optimizer adamw` exits 2 before anything
    loads; bad values exit 2 naming the allowed ones."""
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    from cli_runner import run_cli
    from jqlora.demo import task

    src = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                     config_overrides={"initializer_range": 0.1})
    shutil.copytree(src, tmp_path / "nf4")
    task.save_tokenizer(tmp_path / "nf4")
    task.write_jsonl(tmp_path / "train.jsonl", task.make_split(64, 0, seed=3).train)
    out = tmp_path / "run"
    base = ["train", "--model", tmp_path / "nf4", "--data-path", tmp_path / "train.jsonl", "--compute-dtype",
            "float32", "--rank", "16", "--alpha", "32", "--target-modules", "q_proj,down_proj", "--seq-len", "32",
            "--batch-size", "2", "--lr", "0.01", "--log-every", "1", "--save-every", "0", "--no-tensorboard"]
    rc, text, err = run_cli(capsys, *base, "--out-dir", out, "--steps", "2", "--optimizer", "adamw8bit")
    assert rc == 0, err
    record = json.loads((out / "jqlora_run.json").read_text())
    assert record["train"]["optimizer"] == "adamw8bit"
    (ckpt,) = (out / "checkpoints").iterdir()
    arrays = json.loads((ckpt / "state.json").read_text())["arrays"]
    uint8 = sorted(k for k, m in arrays.items() if k.startswith("opt/") and m["dtype"] == "uint8")
    assert len(uint8) == 2 and all("down_proj" in k for k in uint8), uint8  # mu and nu of down_proj's A
    assert sum("absmax" in k for k in arrays) == 2
    rc, _, err = run_cli(capsys, "train", "--resume", "--out-dir", out, "--steps", "3", "--optimizer", "adamw")
    assert rc == 2 and "optimizer is 'adamw'" in err and "used 'adamw8bit'" in err, err
    rc, _, err = run_cli(capsys, *base, "--out-dir", tmp_path / "bad", "--steps", "1", "--optimizer", "sgd")
    assert rc == 2 and "--optimizer" in err and "adamw8bit" in err, err
    bad = tmp_path / "bad.toml"
    bad.write_text('optimizer = "lion"\n')
    rc, _, err = run_cli(capsys, *base, "--out-dir", tmp_path / "bad", "--steps", "1", "--config", bad)
    assert rc == 2 and "optimizer must be one of adamw, adamw8bit, got 'lion'" in err, err
